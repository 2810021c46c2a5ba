"""Where an LMCache chunk sits in its prefix: the token ids behind the chunk hashes an L2 adapter sees.

LMCache's L2 adapter interface hands an adapter ``ObjectKey``s (model, chunk hash, kv rank, salt) and
the KV, never the tokens or the chunk's place in its prefix. VeriCache's readers need both: a full-copy
manifest names the token range it covers, and the compressed copy is of a whole prefix. This module,
loaded into the same ``lmcache server`` process as the adapter, records them as the server resolves
the keys of a STORE (or RETRIEVE) request::

    lmcache server ... --server-module '{"module_path": "vericache_connector.integration.lmcache.chain_tap"}' \\
                       --l2-adapter '{"type": "plugin", "module_path": "vericache_connector.integration.lmcache.l2_adapter", ...}'

It wraps ``MPCacheServerContext.resolve_obj_keys`` (IPC key with token ids -> ObjectKeys; the one place
where both are known) and remembers, for each chunk hash, its parent's hash and its own token ids
(``TAP``, a bounded LRU: ``--server-module '{..., "config": {"max_chunks": 16384}}'``). It records only
what it has checked: the server's chunk hashes must equal lmcache_keys.lmcache_chain_hashes of the
tokens (``--hash-algorithm blake3``, the default), else it warns once and records nothing. Without the
tap, or for a chunk it no longer holds, the adapter still serves LMCache, but VeriCache readers only
use what they can check (see integration/lmcache/l2_adapter.py).
"""

from __future__ import annotations

import array
import logging
import threading
from collections import OrderedDict

from storage_backends.lmcache_keys import lmcache_chain_hashes

logger = logging.getLogger("vericache.store")
DEFAULT_MAX_CHUNKS = 16384  # ~1 KiB each (256 token ids + a hash): ~17 MiB


class ChainTap:
    """chunk hash (bytes) -> (parent hash or None for a prefix's first chunk, the chunk's token ids)."""

    def __init__(self, max_chunks: int = DEFAULT_MAX_CHUNKS):
        if max_chunks <= 0:
            raise ValueError(f"max_chunks must be > 0, got {max_chunks}")
        self.max_chunks = max_chunks
        self._chunks: OrderedDict[bytes, tuple[bytes | None, array.array]] = OrderedDict()
        self._lock = threading.Lock()
        self._mismatch_warned = False

    def __len__(self) -> int:
        return len(self._chunks)

    def clear(self) -> None:
        with self._lock:
            self._chunks.clear()

    def record(self, token_ids, chunk_size: int, end: int, server_hashes: list[bytes], first_chunk: int) -> bool:
        """Remember chunks [0, end // chunk_size) of token_ids, if the server's hashes of chunks
        first_chunk.. (its resolve result) are ours. Returns whether it recorded them."""
        n = min(len(token_ids), end) // chunk_size
        tokens = list(token_ids[: n * chunk_size])
        ours = [h.to_bytes(32, "big") for h in lmcache_chain_hashes(tokens, chunk_size)]
        if not server_hashes or ours[first_chunk : first_chunk + len(server_hashes)] != list(server_hashes):
            if server_hashes and not self._mismatch_warned:
                self._mismatch_warned = True
                logger.warning(
                    "lmcache chain tap: the server's chunk hashes are not LMCache's blake3 chain hashes "
                    "(--hash-algorithm other than blake3?); token positions are not recorded, VeriCache "
                    "readers will not use these chunks"
                )
            return False
        with self._lock:
            for i, h in enumerate(ours):
                parent = ours[i - 1] if i else None
                self._chunks[h] = (parent, array.array("I", tokens[i * chunk_size : (i + 1) * chunk_size]))
                self._chunks.move_to_end(h)
            while len(self._chunks) > self.max_chunks:
                self._chunks.popitem(last=False)
        return True

    def prefix_tokens(self, chunk_hash: bytes, max_chunks: int = 1 << 16) -> list[int] | None:
        """Token ids of the whole prefix that ends with this chunk, or None if any link is unknown."""
        parts = []
        with self._lock:
            h: bytes | None = chunk_hash
            while h is not None and len(parts) < max_chunks:
                entry = self._chunks.get(h)
                if entry is None:
                    return None
                h, tokens = entry
                parts.append(tokens)
            if h is not None:
                return None
        return [t for part in reversed(parts) for t in part]


TAP = ChainTap()


def observe(key, resolved, chunk_size: int, tap: ChainTap = TAP) -> None:
    """Record what resolve_obj_keys(key, ...) returned (a list per object group of ObjectKeys)."""
    first = next((group for group in resolved if group), None)
    if first is None or key.start % chunk_size:
        return
    tap.record(key.token_ids, chunk_size, key.end, [k.chunk_hash for k in first], key.start // chunk_size)


def build_server_modules(ctx):
    """``lmcache server --server-module`` factory: taps the server context's resolve_obj_keys."""
    server = ctx.server_context
    resolve = getattr(server, "resolve_obj_keys", None)
    chunk_size = getattr(server, "chunk_size", None)
    if not callable(resolve) or not isinstance(chunk_size, int):
        logger.warning("lmcache chain tap: this LMCache server has no resolve_obj_keys/chunk_size; not tapped")
        return None
    max_chunks = (ctx.config or {}).get("max_chunks")
    if max_chunks is not None:
        if isinstance(max_chunks, bool) or not isinstance(max_chunks, int) or max_chunks <= 0:
            raise ValueError(f"lmcache chain tap: max_chunks must be a positive integer, got {max_chunks!r}")
        TAP.max_chunks = max_chunks

    def tapped(key, object_group_ids):
        resolved = resolve(key, object_group_ids)
        try:
            observe(key, resolved, chunk_size)
        except Exception as e:  # noqa: BLE001 - the tap must never fail a request
            logger.warning("lmcache chain tap: not recorded (%s: %s)", type(e).__name__, e)
        return resolved

    server.resolve_obj_keys = tapped
    logger.info("lmcache chain tap: recording chunk positions (chunk_size %d, %d chunks)", chunk_size, TAP.max_chunks)
    return None
