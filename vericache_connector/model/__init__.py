"""The model level, below both engines: a Llama-family decoder over explicit KV caches, the caches, the
checkpoint loader, the lossless rule (sampling.py: `verify` accepts drafts, `emit` applies the token
budget and EOS) and the draft-sending rule (draft_rule.py: when a drafter sends its drafts, and how many).
It imports nothing from the engines, the draft caches or the integrations above it.

    from vericache_connector.model import load_model, resolve_model_dir, verify

Modules: causal_lm.py (CausalLM, ModelConfig, load_model), kv_cache.py (RowCache, KVCache), loader.py
(checkpoints, the bundled model, model identities), sampling.py (DecodeSettings, verify, emit, sample),
draft_rule.py (DraftRule).
Names are resolved on first use, so importing a submodule never pulls in the others.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "CausalLM": "causal_lm",
    "ModelConfig": "causal_lm",
    "load_model": "causal_lm",
    "KVCache": "kv_cache",
    "RowCache": "kv_cache",
    "resolve_model_dir": "loader",
    "model_identity": "loader",
    "DecodeSettings": "sampling",
    "verify": "sampling",
    "emit": "sampling",
    "sample": "sampling",
    "top_token": "sampling",
    "DraftRule": "draft_rule",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))


__all__ = sorted(_EXPORTS)
