"""Remote prefix caching: a dual-copy store (full + compressed) read compressed-first.

config.py (RemoteCacheConfig, the one owner of store settings), store_client.py (a DualCopyStore on
its own event-loop thread), full_copy.py (the full copy streamed layer by layer: shared with the vLLM
connector), prefix_cache.py (RemotePrefixCache: the engine's compressed-first hits).
"""

from __future__ import annotations

from .config import RemoteCacheConfig
from .prefix_cache import RemotePrefixCache, RemoteResult, Timings
from .store_client import StoreClient

__all__ = ["RemoteCacheConfig", "RemotePrefixCache", "RemoteResult", "StoreClient", "Timings"]
