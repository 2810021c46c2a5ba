"""What `vericache demo` runs: three_way.py (one long prompt decoded with full KV, lossy compressed KV
and VeriCache, side by side)."""

from __future__ import annotations

from .three_way import DemoReport, first_divergence, resolve_prompt, run_demo

__all__ = ["DemoReport", "first_divergence", "resolve_prompt", "run_demo"]
