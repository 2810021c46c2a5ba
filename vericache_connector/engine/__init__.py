"""The engine: the model, its KV caches, the draft/verify loop and VeriCacheEngine on top of them.

    from vericache_connector.engine import VeriCacheEngine, DecodeConfig

Modules: model.py (a Llama-family decoder over explicit caches), model_loader.py (checkpoints, the
bundled model), kv_cache.py (RowCache, KVCache), sampling.py (acceptance rules), speculative.py (the
loop, DecodeConfig), llm_engine.py (VeriCacheEngine: prefill, the three decoders).
Names are resolved on first use, so importing a submodule never pulls in the whole engine.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "VeriCacheEngine": "llm_engine",
    "Prefill": "llm_engine",
    "DecodeConfig": "speculative",
    "SpecStats": "speculative",
    "speculative_decode": "speculative",
    "autoregressive_decode": "speculative",
    "KVCache": "kv_cache",
    "RowCache": "kv_cache",
    "CausalLM": "model",
    "ModelConfig": "model",
    "load_model": "model",
    "resolve_model_dir": "model_loader",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))


__all__ = sorted(_EXPORTS)
