"""What `vericache demo` runs: shared_prefix.py (the default: a prefix stored by one node, reused by another
over an emulated slow link, four ways side by side), serving.py (--serving: a long-context trace under a
device KV budget) and three_way.py (--single: one long prompt decoded with full KV, lossy compressed KV and
VeriCache)."""

from __future__ import annotations

from .three_way import DemoReport, first_divergence, resolve_prompt, run_demo

__all__ = ["DemoReport", "first_divergence", "resolve_prompt", "run_demo"]
