"""The engines: both decode with VeriCache's rule (model/sampling.py: draft on the compressed KV, accept only
what the full KV agrees with) and differ in what they serve.

  VeriCacheEngine   (llm_engine.py) one request or a static batch whose full KV and compressed copy are both
                    in memory: prefill, compress, then the speculative loop of speculative.py, where a round
                    is one function (draft k tokens, verify them in one forward, accept, roll back). Use it for
                    a single request, exactness checks, and behind the remote prefix cache (remote/).
  ServingEngine     (serving.py) continuous batching under a device KV budget, the paper's long-context
                    serving: only the compressed KV stays resident, each row's full prompt KV lives in a host
                    tier and is reloaded over the link for its verifications (scheduler.py and rounds.py plan
                    them). A round spans several steps: a row drafts one token per step, then its verify segment
                    rides in a packed forward. Use it for many concurrent long requests under a memory budget.

    from vericache_connector.engine import VeriCacheEngine, DecodeConfig, ServingEngine, ServingConfig, Request

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
    "ServingEngine": "serving",
    "ServingConfig": "config",
    "Request": "sequence",
    "ServingReport": "report",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))


__all__ = sorted(_EXPORTS)
