"""The store client: what every node that reads or writes the dual-copy prefix store shares.

config.py (RemoteCacheConfig: the one owner of store settings, the store path's compressor default),
client.py (StoreClient: a storage_backends.DualCopyStore driven from synchronous code on its own event-loop
thread), full_copy.py (the full copy streamed layer by layer into whatever holds it), cli.py (`vericache store
stats / evict`: what a store holds, eviction for stores without a policy of their own). Used by the engine's
prefix cache and the verifier (remote/), and by both halves of the vLLM connector (integration/vllm/).
It sits just above storage_backends: it imports no model, engine or compressor.
"""

from __future__ import annotations

from .client import ClientClosed, StoreClient
from .config import STORE_DEFAULT, RemoteCacheConfig
from .full_copy import stream_full_copy

__all__ = ["STORE_DEFAULT", "ClientClosed", "RemoteCacheConfig", "StoreClient", "stream_full_copy"]
