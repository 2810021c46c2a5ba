"""Token-bucket bandwidth limit, to emulate a slow link to the store."""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Iterable, Mapping, Sequence

from .base import ObjectInfo, StorageBackend


class TokenBucket:
    """Average rate ``rate`` bytes/s with bursts up to ``burst`` bytes.

    ``acquire(n)`` waits until n bytes may pass; n may exceed the burst (the
    caller then waits n/rate). Callers are served in order.
    """

    def __init__(self, rate: float, burst: float | None = None):
        if not rate or rate <= 0:
            raise ValueError(f"bandwidth must be > 0 bytes/s, got {rate!r}")
        self.rate = float(rate)
        self.burst = float(burst if burst is not None else max(64 * 1024, self.rate / 20))
        if self.burst <= 0:
            raise ValueError(f"burst must be > 0 bytes, got {burst!r}")
        self._tokens = self.burst
        self._last = time.monotonic()
        self._lock: asyncio.Lock | None = None

    def _refill(self) -> None:
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now

    async def acquire(self, n: int) -> None:
        if n <= 0:
            return
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            self._refill()
            self._tokens -= n
            if self._tokens < 0:
                await asyncio.sleep(-self._tokens / self.rate)


class ThrottledBackend(StorageBackend):
    """Wraps a backend; bytes read (and, if given, written) pass a token bucket."""

    def __init__(self, inner: StorageBackend, read_bytes_per_s: float | None, write_bytes_per_s: float | None = None):
        self.inner = inner
        self.url = inner.url
        self.read_bucket = TokenBucket(read_bytes_per_s) if read_bytes_per_s else None
        self.write_bucket = TokenBucket(write_bytes_per_s) if write_bytes_per_s else None

    async def _read(self, data):
        if data is not None and self.read_bucket is not None:
            await self.read_bucket.acquire(len(data))
        return data

    async def _wrote(self, n: int) -> None:
        if self.write_bucket is not None:
            await self.write_bucket.acquire(n)

    async def put(self, key: str, data: bytes) -> None:
        await self._wrote(len(data))
        await self.inner.put(key, data)

    async def get(self, key: str) -> bytes | None:
        return await self._read(await self.inner.get(key))

    async def get_range(self, key: str, start: int, end: int) -> bytes | None:
        return await self._read(await self.inner.get_range(key, start, end))

    async def exists(self, key: str) -> bool:
        return await self.inner.exists(key)

    async def delete(self, key: str) -> None:
        await self.inner.delete(key)

    async def put_many(self, items: Mapping[str, bytes]) -> None:
        await self._wrote(sum(len(v) for v in items.values()))
        await self.inner.put_many(items)

    async def get_many(self, keys: Iterable[str]) -> list[bytes | None]:
        values = await self.inner.get_many(keys)
        if self.read_bucket is not None:
            await self.read_bucket.acquire(sum(len(v) for v in values if v is not None))
        return values

    async def exists_many(self, keys: Iterable[str]) -> list[bool]:
        return await self.inner.exists_many(keys)

    @property
    def refreshes(self) -> bool:
        return self.inner.refreshes

    @property
    def ttl_s(self) -> float | None:
        return self.inner.ttl_s

    async def touch(self, keys: Sequence[str]) -> None:
        await self.inner.touch(keys)

    def scan(self) -> AsyncIterator[ObjectInfo]:
        return self.inner.scan()

    async def close(self) -> None:
        await self.inner.close()
