"""What a store holds, and eviction for stores without a server-side policy (`vericache store stats / evict`).

Keys (keys.py): a copy's manifest is ``BASE@copy%SPEC`` and its payload ``BASE@copy%SPEC@blob%DIGEST``,
where BASE = ``model@world@worker@chunk_hash@dtype[@tags]`` names one chunk of a prefix. Every copy of a
chunk (its full copy, and the compressed copies of the prefix that ends there) shares BASE: that is the
chunk's *group*, the unit of eviction (both copies go together, manifests before payloads, so a reader
never finds a manifest whose payload went first without the manifest going too) and of a Redis Cluster
hash slot (redis_cluster.py).

Eviction order is least recently used first: a group's time is its newest object's (a write, or a refresh
on a hit: DualCopyStore touches a prefix's chunks so that its first chunk counts as the most recent, so a
prefix is evicted from its end and what stays is still a usable shorter prefix).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable

from .base import ObjectInfo, StorageBackend

COPY_TAG = "@copy%"
BLOB_TAG = "@blob%"


@dataclass(frozen=True)
class KeyInfo:
    group: str  # the chunk's base key (the key itself for a key of no copy)
    model: str  # "" for keys that are not the dual-copy store's
    copy: str  # "full", a compressor spec, or "" (not a copy)
    payload: bool  # a payload (else a manifest, or not a copy)
    manifest_key: str  # the manifest a payload belongs to (its own key for a manifest)


def parse_key(key: str) -> KeyInfo:
    base, sep, rest = key.partition(COPY_TAG)
    if not sep:
        return KeyInfo(key, "", "", False, key)
    spec, blob, _ = rest.partition(BLOB_TAG)
    return KeyInfo(base, base.split("@", 1)[0], spec, bool(blob), base + COPY_TAG + spec)


def group_of(key: str) -> str:
    """The chunk a key belongs to (see the module docstring)."""
    return key.partition(COPY_TAG)[0]


@dataclass
class CopyStats:
    entries: int = 0  # manifests: chunks (full copy) or prefixes (compressed copies)
    bytes: int = 0  # manifests and payloads
    oldest: float | None = None
    newest: float | None = None

    def add(self, size: int, used_at: float | None, manifest: bool) -> None:
        self.entries += manifest
        self.bytes += size
        if used_at is not None:
            self.oldest = used_at if self.oldest is None else min(self.oldest, used_at)
            self.newest = used_at if self.newest is None else max(self.newest, used_at)


@dataclass
class StoreStats:
    objects: int = 0
    bytes: int = 0
    copies: dict[tuple[str, str], CopyStats] = field(default_factory=dict)  # (model, copy kind) -> stats
    orphans: int = 0  # payloads whose manifest is gone (an eviction of one key, a write cut short)
    orphan_bytes: int = 0
    other: int = 0  # objects that are not the dual-copy store's
    other_bytes: int = 0

    @property
    def oldest(self) -> float | None:
        times = [c.oldest for c in self.copies.values() if c.oldest is not None]
        return min(times) if times else None

    @property
    def newest(self) -> float | None:
        times = [c.newest for c in self.copies.values() if c.newest is not None]
        return max(times) if times else None


def summarize(objects: Iterable[ObjectInfo]) -> StoreStats:
    objects = list(objects)
    manifests = {o.key for o in objects if parse_key(o.key).copy and not parse_key(o.key).payload}
    st = StoreStats()
    for o in objects:
        info = parse_key(o.key)
        st.objects += 1
        st.bytes += o.size
        if not info.copy:
            st.other, st.other_bytes = st.other + 1, st.other_bytes + o.size
            continue
        if info.payload and info.manifest_key not in manifests:
            st.orphans, st.orphan_bytes = st.orphans + 1, st.orphan_bytes + o.size
            continue
        kind = "full" if info.copy == "full" else info.copy
        st.copies.setdefault((info.model, kind), CopyStats()).add(o.size, o.used_at, not info.payload)
    return st


@dataclass
class Group:
    name: str
    keys: list[str]
    bytes: int
    used_at: float  # its newest object's time (0 when unknown: evicted first)


def groups(objects: Iterable[ObjectInfo]) -> list[Group]:
    """Objects by chunk, least recently used first; in each, manifests before payloads."""
    by: dict[str, Group] = {}
    for o in objects:
        g = by.setdefault(group_of(o.key), Group(group_of(o.key), [], 0, 0.0))
        g.keys.append(o.key)
        g.bytes += o.size
        g.used_at = max(g.used_at, o.used_at or 0.0)
    for g in by.values():
        g.keys.sort(key=lambda k: (parse_key(k).payload, k))
    return sorted(by.values(), key=lambda g: (g.used_at, g.name))


def plan(
    objects: Iterable[ObjectInfo],
    max_bytes: int | None = None,
    older_than_s: float | None = None,
    now: float | None = None,
    keep: str | None = None,
) -> list[Group]:
    """The groups to delete, in order: every group last used more than older_than_s ago, then the least
    recently used until the rest fits max_bytes. keep: a group never chosen (the one being written)."""
    now = time.time() if now is None else now
    objects = list(objects)
    total = sum(o.size for o in objects)
    out = []
    for g in groups(objects):  # least recently used first: once one stays, every later one does
        old = older_than_s is not None and g.used_at < now - older_than_s
        over = max_bytes is not None and total > max_bytes
        if not (old or over):
            break
        if g.name != keep:
            out.append(g)
            total -= g.bytes
    return out


@dataclass
class EvictResult:
    groups: int
    objects: int
    bytes: int
    left_bytes: int


async def evict(
    backend: StorageBackend, max_bytes: int | None = None, older_than_s: float | None = None, dry_run: bool = False
) -> EvictResult:
    """Delete whole chunks, least recently used first, until the store holds at most max_bytes, and/or
    every chunk unused for more than older_than_s (`vericache store evict`)."""
    if max_bytes is None and older_than_s is None:
        raise ValueError("evict needs max_bytes or older_than_s")
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    if older_than_s is not None and not older_than_s >= 0:
        raise ValueError(f"older_than_s must be >= 0, got {older_than_s}")
    objects = [o async for o in backend.scan()]
    chosen = plan(objects, max_bytes, older_than_s)
    gone = sum(g.bytes for g in chosen)
    if not dry_run:
        for g in chosen:
            for key in g.keys:  # manifests first: a half-deleted chunk is a miss, never a broken hit
                await backend.delete(key)
    return EvictResult(len(chosen), sum(len(g.keys) for g in chosen), gone, sum(o.size for o in objects) - gone)
