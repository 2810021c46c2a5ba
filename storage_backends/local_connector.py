"""local:// stores: process memory (local://[name]) or a disk directory (local:///dir).

A disk store takes a capacity, ``local:///dir?max_bytes=N``: a write that would take the directory past N
bytes first deletes the least recently used chunks (inventory.py: a chunk's copies go together) until 90% of
N is left, so the directory never holds more than N bytes of entries. A file's mtime is its last write or
use (DualCopyStore touches what a hit reads). Each process counts its own writes from a scan of the
directory, and scans again before it would pass N and after every N/8 bytes it wrote: with several
processes writing one directory, it can pass N by what the others wrote since this one's last scan.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from typing import AsyncIterator, Iterable, Mapping, Sequence
from urllib.parse import quote, unquote

from .base import (
    ObjectInfo,
    StorageBackend,
    StoreError,
    StoreUnavailable,
    check_range,
    logger,
    pop_optional,
    query_options,
    redact_url,
    split_url,
    unknown_options,
)
from .inventory import group_of, plan

# Named in-process stores, shared by every backend opened on the same name.
_MEMORY: dict[str, dict[str, bytes]] = {}
_MEMORY_LOCK = threading.Lock()

# Values at least this big are read/written in a worker thread.
_THREAD_MIN_BYTES = 1 << 20
_NAME_MAX = 200  # longer file names are split into folders under _LONG (file systems allow 255 bytes)
_LONG = "_long.d"
LOW_WATER = 0.9  # an eviction leaves this share of max_bytes


def open_local(url: str, **opts) -> StorageBackend:
    parts = split_url(url)
    opts = {**query_options(url), **opts}
    fsync = str(opts.pop("fsync", "0")).lower() in ("1", "true", "yes")
    max_bytes = pop_optional(opts, "max_bytes", int)
    for name in ("timeout_s", "connect_timeout_s"):  # nothing to wait for here
        opts.pop(name, None)
    if opts:
        raise unknown_options(opts, url)
    if parts.path not in ("", "/"):
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"bad store URL {redact_url(url)!r}: use local:///abs/dir for a disk store")
        return DiskBackend(parts.path, url=url, fsync=fsync, max_bytes=max_bytes)
    if max_bytes is not None:
        raise ValueError(f"max_bytes={max_bytes} is for disk stores (local:///dir), not {redact_url(url)!r}")
    return MemoryBackend(parts.netloc or "default", url=url)


class MemoryBackend(StorageBackend):
    """In-process dict; backends opened on the same name share their data."""

    def __init__(self, name: str = "default", url: str | None = None):
        self.name = name
        self.url = url or f"local://{name}"
        with _MEMORY_LOCK:
            self._data = _MEMORY.setdefault(name, {})

    async def put(self, key: str, data: bytes) -> None:
        self._data[key] = bytes(data)

    async def get(self, key: str) -> bytes | None:
        return self._data.get(key)

    async def get_range(self, key: str, start: int, end: int) -> bytes | None:
        check_range(start, end)
        value = self._data.get(key)
        return None if value is None else value[start:end]

    async def exists(self, key: str) -> bool:
        return key in self._data

    async def delete(self, key: str) -> None:
        self._data.pop(key, None)

    async def scan(self) -> AsyncIterator[ObjectInfo]:
        for key, value in list(self._data.items()):
            yield ObjectInfo(key, len(value), None)


class DiskBackend(StorageBackend):
    """One file per key; writes go to a temp file renamed into place (atomic). max_bytes: the module docstring."""

    def __init__(self, root: str, url: str | None = None, fsync: bool = False, max_bytes: int | None = None):
        self.root = os.path.abspath(root)
        self.url = url or f"local://{self.root}"
        self.fsync = fsync
        self.max_bytes = max_bytes
        self.refreshes = max_bytes is not None
        self._lock = threading.Lock()  # writes and evictions of a bounded store, one at a time
        self._used: int | None = None  # bytes at the last scan + this process's writes since
        self._since_scan = 0
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            raise StoreUnavailable(f"{self.url}: cannot create directory: {e}") from e

    def path(self, key: str) -> str:
        """root/NAME, NAME the key percent-encoded; a longer name (or one starting with '.') is split into
        folders of at most _NAME_MAX characters under root/_long.d, each prefixed with '_'."""
        name = quote(key, safe="@:=,.-_+")
        if len(name) > _NAME_MAX or name.startswith(".") or name == _LONG:
            parts = ["_" + name[i : i + _NAME_MAX] for i in range(0, len(name), _NAME_MAX)]
            return os.path.join(self.root, _LONG, *parts)
        return os.path.join(self.root, name)

    def _key_of(self, rel: str) -> str:
        parts = rel.split(os.sep)
        if parts[0] == _LONG:
            return unquote("".join(p[1:] for p in parts[1:]))
        return unquote(rel)

    def _objects(self) -> list[ObjectInfo]:
        out = []
        for folder, dirs, files in os.walk(self.root):
            for name in files:
                if name.startswith(".tmp-"):
                    continue
                path = os.path.join(folder, name)
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    continue
                out.append(ObjectInfo(self._key_of(os.path.relpath(path, self.root)), st.st_size, st.st_mtime))
        return out

    def _make_room(self, key: str, n: int) -> None:
        """Under self._lock: delete least recently used chunks (never key's own) until n more bytes fit."""
        if n > self.max_bytes:
            raise StoreError(f"{self.url}: an object of {n} bytes does not fit max_bytes={self.max_bytes}")
        if self._used is not None and self._used + n <= self.max_bytes and self._since_scan <= self.max_bytes // 8:
            return
        objects = self._objects()
        self._used, self._since_scan = sum(o.size for o in objects), 0
        if self._used + n <= self.max_bytes:
            return
        low = max(0, int(self.max_bytes * LOW_WATER) - n)
        chosen = plan(objects, low, keep=group_of(key))
        for g in chosen:
            for k in g.keys:  # manifests first (inventory.groups)
                self._unlink(k)
            self._used -= g.bytes
        logger.info(
            "%s: evicted %d chunks (%d bytes) for max_bytes", self.url, len(chosen), sum(g.bytes for g in chosen)
        )
        if self._used + n > self.max_bytes:
            raise StoreError(f"{self.url}: no room for {n} bytes within max_bytes={self.max_bytes}")

    def _unlink(self, key: str) -> None:
        try:
            os.unlink(self.path(key))
        except FileNotFoundError:
            pass

    def _write(self, key: str, data: bytes) -> None:
        if self.max_bytes is None:
            return self._write_file(key, data)
        with self._lock:
            self._make_room(key, len(data))
            self._write_file(key, data)
            self._used += len(data)
            self._since_scan += len(data)

    def _write_file(self, key: str, data: bytes) -> None:
        tmp = os.path.join(self.root, f".tmp-{uuid.uuid4().hex}")
        try:
            path = self.path(key)
            if os.path.dirname(path) != self.root:
                os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise StoreUnavailable(f"{self.url}: write of {key!r} failed: {e}") from e

    def _read(self, key: str, start: int = 0, end: int | None = None) -> bytes | None:
        try:
            with open(self.path(key), "rb") as f:
                if start:
                    f.seek(start)
                return f.read() if end is None else f.read(max(0, end - start))
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreUnavailable(f"{self.url}: read of {key!r} failed: {e}") from e

    async def put(self, key: str, data: bytes) -> None:
        if len(data) >= _THREAD_MIN_BYTES or self.max_bytes is not None:  # an eviction scans: not on the loop
            await asyncio.to_thread(self._write, key, data)
        else:
            self._write(key, data)

    async def get(self, key: str) -> bytes | None:
        return await asyncio.to_thread(self._read, key)

    async def get_range(self, key: str, start: int, end: int) -> bytes | None:
        check_range(start, end)
        if end - start >= _THREAD_MIN_BYTES:
            return await asyncio.to_thread(self._read, key, start, end)
        return self._read(key, start, end)

    async def exists(self, key: str) -> bool:
        return os.path.exists(self.path(key))

    async def delete(self, key: str) -> None:
        self._unlink(key)

    async def touch(self, keys: Sequence[str]) -> None:
        t = time.time_ns()
        for i, key in enumerate(keys):  # later keys: later times
            try:
                os.utime(self.path(key), ns=(t + i * 1000, t + i * 1000))
            except FileNotFoundError:
                pass

    async def scan(self) -> AsyncIterator[ObjectInfo]:
        for o in await asyncio.to_thread(self._objects):
            yield o

    async def put_many(self, items: Mapping[str, bytes]) -> None:
        await asyncio.to_thread(lambda: [self._write(k, v) for k, v in items.items()])

    async def get_many(self, keys: Iterable[str]) -> list[bytes | None]:
        keys = list(keys)
        return await asyncio.to_thread(lambda: [self._read(k) for k in keys])
