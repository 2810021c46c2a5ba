"""LMCache-compatible chunk keys with a prefix-chained, process-stable token hash.

Base key = LMCache 0.5.x ``CacheEngineKey.to_string()`` layout:
``model_name@world_size@worker_id@chunk_hash_hex@dtype``. We append LMCache-style
tags (``@name%value``) to tell the copies apart:
``...@copy%full`` or ``...@copy%kivi:bits=4`` (manifest) and
``...@copy%<spec>@blob%<digest>`` (payload). LMCache's ``CacheEngineKey.from_string``
parses these strings (tags become ``lmcache.tag.*`` request configs).

Chunk hash: h_i = blake2b-64(h_{i-1} || tokens_i as int64 LE), h_{-1} = 0, the
hash of a chunk depends on every token before it. hashlib only, never hash().
"""

from __future__ import annotations

import hashlib
import re
import struct
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .identity import dtype_str
from .identity import torch_dtype as torch_dtype  # its old home: integration/lmcache/l2_config.py imports it here
from .lmcache_keys import check_hashing, lmcache_chain_hashes, salt_tag

DEFAULT_CHUNK_SIZE = 256
FULL = "full"

_SPEC_RE = re.compile(r"^[A-Za-z0-9_.:=,+\-]+$")


def check_spec(spec: str) -> str:
    """A copy spec ('full' or a compressor spec like 'kivi:bits=4,group=32')."""
    if not isinstance(spec, str) or not _SPEC_RE.match(spec):
        raise ValueError(f"bad copy spec {spec!r}: use letters, digits and _.:=,+- only (no @ % / spaces)")
    return spec


def stored_prefix_len(num_tokens: int, chunk_size: int = DEFAULT_CHUNK_SIZE) -> int:
    """Tokens of a prompt of num_tokens that a prefix store holds: whole chunks, leaving at least one
    token outside (its forward gives the logits of the first generated token)."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    return max(0, (num_tokens - 1) // chunk_size * chunk_size)


def chain_hashes(token_ids: Sequence[int], chunk_size: int = DEFAULT_CHUNK_SIZE) -> list[int]:
    """Chained 64-bit hash of each chunk (the last one may be partial)."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.reshape(-1).tolist()
    tokens = list(token_ids)
    prev = b"\x00" * 8
    out = []
    for start in range(0, len(tokens), chunk_size):
        chunk = tokens[start : start + chunk_size]
        try:
            data = struct.pack(f"<{len(chunk)}q", *chunk)
        except struct.error as e:
            raise ValueError(f"token ids must be 64-bit ints: {e}") from None
        prev = hashlib.blake2b(prev + data, digest_size=8).digest()
        out.append(int.from_bytes(prev, "big"))
    return out


@dataclass(frozen=True)
class ChunkKey:
    """One chunk of a prefix: tokens [start, end), LMCache-style base key string."""

    base: str
    chunk_hash: int
    start: int
    end: int

    def copy(self, spec: str) -> str:
        """Key of the manifest of copy ``spec`` of the prefix ending at this chunk."""
        return f"{self.base}@copy%{check_spec(spec)}"

    def blob(self, spec: str, digest: str) -> str:
        """Key of a payload of copy ``spec``; content-addressed, never overwritten."""
        return f"{self.copy(spec)}@blob%{digest}"


@dataclass(frozen=True)
class KeySpace:
    """Keys of one model + KV dtype (+ TP layout). Other models/dtypes never collide.

    hashing: "vericache" (chain_hashes) or "lmcache" (the chunk hashes of LMCache's multiprocess server,
      lmcache_keys.lmcache_chain_hashes), to share a store with an LMCache server (integration/lmcache/l2_adapter.py).
    cache_salt: LMCache's per-tenant salt: entries under one salt are invisible under any other ('' none).
    """

    model_name: str
    dtype: torch.dtype | str
    chunk_size: int = DEFAULT_CHUNK_SIZE
    world_size: int = 1
    worker_id: int = 0
    hashing: str = "vericache"
    cache_salt: str = ""
    dtype_name: str = field(init=False, repr=False)

    def __post_init__(self):
        if not self.model_name or "@" in self.model_name or "%" in self.model_name:
            raise ValueError(f"bad model_name {self.model_name!r}: must be non-empty, no '@' or '%'")
        if self.chunk_size <= 0:
            raise ValueError(f"chunk_size must be > 0, got {self.chunk_size}")
        if not 0 <= self.worker_id < max(1, self.world_size):
            raise ValueError(f"bad worker_id {self.worker_id} for world_size {self.world_size}")
        object.__setattr__(self, "dtype_name", dtype_str(self.dtype))
        check_hashing(self.hashing)
        object.__setattr__(self, "_tag", salt_tag(self.cache_salt))

    def base_key(self, chunk_hash: int) -> str:
        return f"{self.model_name}@{self.world_size}@{self.worker_id}@{chunk_hash:x}@{self.dtype_name}{self._tag}"

    def chunks(self, token_ids: Sequence[int]) -> list[ChunkKey]:
        """Keys of every chunk of token_ids, in order; the last may be partial."""
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.reshape(-1).tolist()
        n = len(token_ids)
        hashes = lmcache_chain_hashes if self.hashing == "lmcache" else chain_hashes
        return [
            ChunkKey(self.base_key(h), h, i * self.chunk_size, min(n, (i + 1) * self.chunk_size))
            for i, h in enumerate(hashes(token_ids, self.chunk_size))
        ]

    def prefix_key(self, token_ids: Sequence[int]) -> ChunkKey:
        """Key of the whole prefix = key of its last chunk."""
        chunks = self.chunks(token_ids)
        if not chunks:
            raise ValueError("empty token_ids: a prefix needs at least one token")
        return chunks[-1]
