"""redis://host:port/db store (redis-py asyncio); rediss:// is the same over TLS. Its Cluster and Sentinel
variants (redis_cluster.py, redis_sentinel.py) differ only in how they connect and name keys."""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Iterable, Mapping, Sequence
from urllib.parse import urlunsplit

from .base import (
    ENCODE_HINT,
    BackendOptions,
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
from .credentials import redact_text


class RedisBackend(StorageBackend):
    """Values are plain Redis strings; SET is atomic, so a put is all-or-nothing.

    Options (kwargs or URL query): timeout_s, connect_timeout_s, prefix (prepended to every key),
    max_connections, ttl_s (every key expires this long after its last write or refresh: SET ... PX, and
    touch is PEXPIRE; none by default: keys stay until deleted or evicted by Redis' maxmemory policy).
    """

    USAGE = "redis://[[user]:password@]host:port/db"

    def __init__(self, url: str, **opts):
        self.url = redact_url(url)  # for messages and logs; the client gets the real one
        self._secret_url = url
        self._parse(url)
        opts = {**query_options(url), **opts}
        self.options = BackendOptions.pop_from(opts)
        self.prefix = str(opts.pop("prefix", ""))
        self.max_connections = int(opts.pop("max_connections", 32))
        self.ttl_s = pop_optional(opts, "ttl_s")
        self.refreshes = self.ttl_s is not None
        self._take_options(opts)
        if opts:
            raise unknown_options(opts, url)
        self._client = None

    def _bad(self, why: str = "") -> ValueError:
        return ValueError(
            f"bad store URL {self.url!r}: {why}{', ' if why else ''}expected {self.USAGE} ({ENCODE_HINT})"
        )

    def _parse(self, url: str) -> None:
        parts = split_url(url)
        try:
            port_ok = parts.port is None or parts.port >= 0
        except ValueError:
            port_ok = False
        if not parts.hostname or not port_ok or "@" in parts.path + parts.fragment:
            raise self._bad()
        self._client_url = urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))

    def _take_options(self, opts: dict) -> None:
        """Options of a variant (popped from opts)."""

    def _connection_kwargs(self) -> dict:
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        return dict(
            socket_timeout=self.options.timeout_s,
            socket_connect_timeout=self.options.connect_timeout_s,
            retry=Retry(NoBackoff(), 0),
            max_connections=self.max_connections,
        )

    def _make_client(self):
        import redis.asyncio as aioredis

        return aioredis.Redis.from_url(self._client_url, **self._connection_kwargs())

    def _redis(self):
        if self._client is None:
            self._client = self._make_client()
        return self._client

    async def _call(self, what: str, make_coro):
        from redis.exceptions import ConnectionError as RConnError
        from redis.exceptions import RedisClusterException, RedisError
        from redis.exceptions import TimeoutError as RTimeout

        client = self._redis()
        try:
            return await asyncio.wait_for(make_coro(client), self.options.timeout_s * 2)
        except (RConnError, RTimeout, OSError, asyncio.TimeoutError, EOFError) as e:
            msg = f"{self.url}: {what} failed: {type(e).__name__}: {redact_text(e, self._secret_url)}"
            logger.warning("redis %s", msg)
            raise StoreUnavailable(msg) from e
        except (RedisError, RedisClusterException) as e:  # OOM, READONLY, not a cluster, other replies: a store error
            msg = f"{self.url}: {what} refused: {type(e).__name__}: {redact_text(e, self._secret_url)}"
            logger.warning("redis %s", msg)
            raise StoreError(msg) from e

    def _k(self, key: str) -> str:
        return self.prefix + key

    def _unk(self, name: bytes) -> str | None:
        """The key of a Redis key name (None: not under this prefix)."""
        name = name.decode("utf-8", "replace")
        return name[len(self.prefix) :] if name.startswith(self.prefix) else None

    @property
    def _px(self) -> int | None:
        return None if self.ttl_s is None else max(1, int(self.ttl_s * 1000))

    async def put(self, key: str, data: bytes) -> None:
        await self._call("SET", lambda r: r.set(self._k(key), data, px=self._px))

    async def get(self, key: str) -> bytes | None:
        return await self._call("GET", lambda r: r.get(self._k(key)))

    async def get_range(self, key: str, start: int, end: int) -> bytes | None:
        check_range(start, end)
        k = self._k(key)

        async def run(r):
            async with r.pipeline(transaction=True) as pipe:
                pipe.exists(k)
                if end > start:
                    pipe.getrange(k, start, end - 1)
                found, *rest = await pipe.execute()
            if not found:
                return None
            return rest[0] if rest else b""

        return await self._call("GETRANGE", run)

    async def exists(self, key: str) -> bool:
        return bool(await self._call("EXISTS", lambda r: r.exists(self._k(key))))

    async def delete(self, key: str) -> None:
        await self._call("DEL", lambda r: r.delete(self._k(key)))

    async def put_many(self, items: Mapping[str, bytes]) -> None:
        if not items:
            return

        async def run(r):
            async with r.pipeline(transaction=False) as pipe:
                for k, v in items.items():
                    pipe.set(self._k(k), v, px=self._px)
                await pipe.execute()

        await self._call("pipelined SET", run)

    async def get_many(self, keys: Iterable[str]) -> list[bytes | None]:
        keys = [self._k(k) for k in keys]
        if not keys:
            return []
        return list(await self._call("MGET", lambda r: self._mget(r, keys)))

    def _mget(self, r, keys: list[str]):
        return r.mget(keys)

    async def touch(self, keys: Sequence[str]) -> None:
        if self.ttl_s is None or not keys:
            return

        async def run(r):
            async with r.pipeline(transaction=False) as pipe:
                for k in keys:
                    pipe.pexpire(self._k(k), self._px)
                await pipe.execute()

        await self._call("PEXPIRE", run)

    async def scan(self) -> AsyncIterator[ObjectInfo]:
        """Every key under the prefix, its size and last access (OBJECT IDLETIME; None under an LFU policy)."""
        names = await self._call("SCAN", self._scan_names)
        now = time.time()
        for i in range(0, len(names), 500):
            batch = names[i : i + 500]

            async def sizes(r, batch=batch):
                async with r.pipeline(transaction=False) as pipe:
                    for n in batch:
                        pipe.strlen(n)
                        pipe.object("idletime", n)
                    return await pipe.execute(raise_on_error=False)

            got = await self._call("STRLEN", sizes)
            for n, size, idle in zip(batch, got[::2], got[1::2]):
                key = self._unk(n)
                if key is not None and isinstance(size, int):
                    yield ObjectInfo(key, size, now - idle if isinstance(idle, int) else None)

    async def _scan_names(self, r) -> list[bytes]:
        return [n async for n in r.scan_iter(match=_glob_escape(self.prefix) + "*", count=1000)]

    async def exists_many(self, keys: Iterable[str]) -> list[bool]:
        keys = [self._k(k) for k in keys]
        if not keys:
            return []

        async def run(r):
            async with r.pipeline(transaction=False) as pipe:
                for k in keys:
                    pipe.exists(k)
                return [bool(x) for x in await pipe.execute()]

        return await self._call("EXISTS", run)

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                await asyncio.wait_for(client.aclose(), self.options.timeout_s)
            except Exception as e:  # closing a dead connection must not raise
                logger.debug("redis close on %s: %s", self.url, redact_text(e, self._secret_url))


def _glob_escape(text: str) -> str:
    """text as a literal in a SCAN MATCH pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
