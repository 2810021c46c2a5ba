"""LMCache's keys in ours: what both LMCache integrations share.

Used by the legacy ``remote_storage_plugins`` connector (integration/lmcache/plugin.py), the multiprocess-mode L2
adapter (integration/lmcache/l2_adapter.py) and, through ``KeySpace(hashing="lmcache", cache_salt=...)``, every
VeriCache reader and writer that shares a store with an LMCache server.

- Model identity: ``resolve_model_id`` turns the options ``model_id`` / ``model_dir`` (+ ``model_name``,
  ``kv_dtype``) into the id VeriCache's engine and vLLM connector name the model by
  (identity.dir_model_id); ``ModelNaming`` puts it in place of LMCache's model name in keys.
- Chunk hashes: LMCache's multiprocess server (``lmcache server``) hashes chunks itself, with
  ``--hash-algorithm blake3`` by default (lmcache.v1.multiprocess.token_hasher): h_i = blake3(h_{i-1} ||
  the chunk's token ids as big-endian uint32), h_{-1} = blake3(int64 0 || uint32 0), 32 bytes.
  ``lmcache_chain_hashes`` computes the same values from token ids, so a VeriCache node finds the chunks
  an LMCache server stored (and the server finds VeriCache's). Other ``--hash-algorithm`` values are
  not supported (their keys never match: a miss, never a wrong hit).
- Cache salt (LMCache's per-tenant isolation, ``ObjectKey.cache_salt``): a non-empty salt becomes a
  ``@salt%<hex>`` tag of the base key, so every copy of a salted prefix lives under keys no other salt
  (and no unsalted reader) computes.

Nothing here imports lmcache; blake3 (a dependency of lmcache and of vLLM) is imported on first use.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Sequence

from .identity import dir_model_id

HASHINGS = ("vericache", "lmcache")
SALT_MAX_LEN = 128  # LMCache's ObjectKey limit
_SALT_FORBIDDEN = frozenset("@/\\\x00")  # ditto


def check_hashing(hashing: str) -> str:
    if hashing not in HASHINGS:
        raise ValueError(f"bad key hashing {hashing!r}: expected one of {', '.join(HASHINGS)}")
    return hashing


def check_salt(salt: str) -> str:
    """A cache salt as LMCache accepts it: a string of at most 128 characters, none of '@', '/', '\\', NUL."""
    if not isinstance(salt, str) or len(salt) > SALT_MAX_LEN or _SALT_FORBIDDEN & set(salt):
        shown = repr(salt) if isinstance(salt, str) and len(salt) <= SALT_MAX_LEN else f"of type/length {type(salt)}"
        raise ValueError(f"bad cache_salt {shown}: at most {SALT_MAX_LEN} characters, none of '@', '/', '\\', NUL")
    return salt


def salt_tag(salt: str) -> str:
    """The base-key tag of a cache salt ('' for no salt; hex, so any salt is one unambiguous tag)."""
    return f"@salt%{check_salt(salt).encode().hex()}" if salt else ""


def _none_hash(blake3) -> bytes:
    return blake3.blake3((0).to_bytes(8, "big", signed=True) + struct.pack(">I", 0)).digest()


def lmcache_chain_hashes(token_ids: Sequence[int], chunk_size: int = 256) -> list[int]:
    """LMCache MP server's chunk hash of each chunk of token_ids (the last may be partial: LMCache never
    stores one, VeriCache's own keys may), as unsigned big-endian ints of the 32-byte digests."""
    import blake3

    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    tokens = list(token_ids.reshape(-1).tolist() if hasattr(token_ids, "reshape") else token_ids)
    prev, out = _none_hash(blake3), []
    for start in range(0, len(tokens), chunk_size):
        chunk = tokens[start : start + chunk_size]
        try:
            data = struct.pack(f">{len(chunk)}I", *chunk)
        except struct.error as e:
            raise ValueError(f"token ids must fit in uint32 for LMCache's chunk hash: {e}") from None
        prev = blake3.blake3(prev + data).digest()
        out.append(int.from_bytes(prev, "big"))
    return out


def resolve_model_id(opts: dict, kv_dtype) -> str | None:
    """Take model_id / model_dir / model_name / kv_dtype out of opts: the id keys carry, or None (keep
    LMCache's model name)."""
    mid, mdir = opts.pop("model_id", None), opts.pop("model_dir", None)
    name, dtype = opts.pop("model_name", None), opts.pop("kv_dtype", None) or kv_dtype
    if mid and mdir:
        raise ValueError("set model_id or model_dir, not both")
    if mid:
        if not isinstance(mid, str) or "@" in mid or "%" in mid:
            raise ValueError(f"bad model_id {mid!r}: a non-empty string without '@' or '%'")
        return mid
    if mdir:
        return dir_model_id(mdir, dtype, name)
    if name:
        raise ValueError("model_name needs model_dir (the fingerprint is over its files)")
    return None


@dataclass(frozen=True)
class ModelNaming:
    """The model name keys carry for a model LMCache names ``lmcache_name``.

    model_id: VeriCache's id of the model (resolve_model_id), or None to keep LMCache's names.
    served_model: the one LMCache model name model_id stands for (an LMCache server may serve several
      models: the others keep their own names); None renames every model (one model per server).
    """

    model_id: str | None = None
    served_model: str | None = None

    def key_model(self, lmcache_name: str) -> str:
        if self.model_id is None or (self.served_model is not None and lmcache_name != self.served_model):
            return lmcache_name
        return self.model_id


def kv_rank_layout(kv_rank: int) -> tuple[int, int]:
    """(world_size, worker_id) of an LMCache MP ``ObjectKey.kv_rank`` (ObjectKey.ComputeKVRank packs
    world_size << 24 | global_rank << 16 | local_world_size << 8 | local_rank)."""
    return (kv_rank >> 24) & 0xFF, (kv_rank >> 16) & 0xFF
