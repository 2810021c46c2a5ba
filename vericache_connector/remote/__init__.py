"""Remote prefix caching on the engine: compressed copy first, and the ZeroMQ drafter / verifier pair.

What stays here, above the engine:
  prefix_cache.py, hit.py     RemotePrefixCache: the engine's compressed-first hit (draft on the compressed
                              copy while the full copy streams in) and what a request returns (RemoteResult)
  verified_hit.py             its second path: drafts checked by a verifier beside the store, the full copy
                              never fetched here (and the local finish when the verifier fails)
  drafter.py, client.py       the drafter's side: VerifiedDecode's loop, the VerifierClient protocol
  rpc.py, auth.py             the drafter <-> verifier protocol (msgspec over ZeroMQ, CURVE keys, tokens)
  gate.py, peer_log.py        the verifier's socket and its gate (the handshake, connection budgets), and what
                              a peer can put in its log (escaped, at a bounded rate)
  verifier.py, *_server.py    `vericache verifier` and `vericache drafter` (verifier_metrics.py: the
                              verifier's /metrics); openai_verifier.py: a vLLM server as the verifier;
                              cli_args.py, drafter_api.py: their options and request shape
The store client moved to store/ (below the engine), the vLLM router to router/ (beside this folder).
"""

from __future__ import annotations

from ..store import RemoteCacheConfig, StoreClient
from .hit import RemoteResult, Timings
from .prefix_cache import RemotePrefixCache

__all__ = ["RemoteCacheConfig", "RemotePrefixCache", "RemoteResult", "StoreClient", "Timings"]
