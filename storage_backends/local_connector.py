"""local:// stores: process memory (local://[name]) or a disk directory (local:///dir)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import uuid
from typing import Iterable, Mapping
from urllib.parse import quote

from .base import StorageBackend, StoreUnavailable, check_range, query_options, redact_url, split_url, unknown_options

# Named in-process stores, shared by every backend opened on the same name.
_MEMORY: dict[str, dict[str, bytes]] = {}
_MEMORY_LOCK = threading.Lock()

# Values at least this big are read/written in a worker thread.
_THREAD_MIN_BYTES = 1 << 20


def open_local(url: str, **opts) -> StorageBackend:
    parts = split_url(url)
    opts = {**query_options(url), **opts}
    fsync = str(opts.pop("fsync", "0")).lower() in ("1", "true", "yes")
    for name in ("timeout_s", "connect_timeout_s"):  # nothing to wait for here
        opts.pop(name, None)
    if opts:
        raise unknown_options(opts, url)
    if parts.path not in ("", "/"):
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"bad store URL {redact_url(url)!r}: use local:///abs/dir for a disk store")
        return DiskBackend(parts.path, url=url, fsync=fsync)
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


class DiskBackend(StorageBackend):
    """One file per key; writes go to a temp file renamed into place (atomic)."""

    def __init__(self, root: str, url: str | None = None, fsync: bool = False):
        self.root = os.path.abspath(root)
        self.url = url or f"local://{self.root}"
        self.fsync = fsync
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            raise StoreUnavailable(f"{self.url}: cannot create directory: {e}") from e

    def path(self, key: str) -> str:
        name = quote(key, safe="@:=,.-_+")
        if len(name) > 200 or name.startswith("."):
            name = "h_" + hashlib.blake2b(key.encode(), digest_size=20).hexdigest()
        return os.path.join(self.root, name)

    def _write(self, key: str, data: bytes) -> None:
        tmp = os.path.join(self.root, f".tmp-{uuid.uuid4().hex}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, self.path(key))
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
        if len(data) >= _THREAD_MIN_BYTES:
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
        try:
            os.unlink(self.path(key))
        except FileNotFoundError:
            pass

    async def put_many(self, items: Mapping[str, bytes]) -> None:
        await asyncio.to_thread(lambda: [self._write(k, v) for k, v in items.items()])

    async def get_many(self, keys: Iterable[str]) -> list[bytes | None]:
        keys = list(keys)
        return await asyncio.to_thread(lambda: [self._read(k) for k in keys])
