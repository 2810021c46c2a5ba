"""redis://host:port/db store (redis-py asyncio)."""

from __future__ import annotations

import asyncio
from typing import Iterable, Mapping
from urllib.parse import urlunsplit

from .base import (
    ENCODE_HINT,
    BackendOptions,
    StorageBackend,
    StoreError,
    StoreUnavailable,
    check_range,
    logger,
    query_options,
    redact_url,
    split_url,
    unknown_options,
)
from .credentials import redact_text


class RedisBackend(StorageBackend):
    """Values are plain Redis strings; SET is atomic, so a put is all-or-nothing.

    Options (kwargs or URL query): timeout_s, connect_timeout_s, prefix (prepended
    to every key), max_connections.
    """

    def __init__(self, url: str, **opts):
        shown = redact_url(url)  # for messages and logs; the client gets the real one
        parts = split_url(url)
        try:
            port_ok = parts.port is None or parts.port >= 0
        except ValueError:
            port_ok = False
        if not parts.hostname or not port_ok or "@" in parts.path + parts.fragment:
            raise ValueError(
                f"bad store URL {shown!r}: expected redis://[[user]:password@]host:port/db ({ENCODE_HINT})"
            )
        opts = {**query_options(url), **opts}
        self.options = BackendOptions.pop_from(opts)
        self.prefix = str(opts.pop("prefix", ""))
        self.max_connections = int(opts.pop("max_connections", 32))
        if opts:
            raise unknown_options(opts, url)
        self.url = shown
        self._secret_url = url
        self._client_url = urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))
        self._client = None

    def _redis(self):
        if self._client is None:
            import redis.asyncio as aioredis
            from redis.backoff import NoBackoff
            from redis.retry import Retry

            self._client = aioredis.Redis.from_url(
                self._client_url,
                socket_timeout=self.options.timeout_s,
                socket_connect_timeout=self.options.connect_timeout_s,
                retry=Retry(NoBackoff(), 0),
                max_connections=self.max_connections,
            )
        return self._client

    async def _call(self, what: str, make_coro):
        from redis.exceptions import ConnectionError as RConnError
        from redis.exceptions import RedisError
        from redis.exceptions import TimeoutError as RTimeout

        client = self._redis()
        try:
            return await asyncio.wait_for(make_coro(client), self.options.timeout_s * 2)
        except (RConnError, RTimeout, OSError, asyncio.TimeoutError, EOFError) as e:
            msg = f"{self.url}: {what} failed: {type(e).__name__}: {redact_text(e, self._secret_url)}"
            logger.warning("redis %s", msg)
            raise StoreUnavailable(msg) from e
        except RedisError as e:  # OOM, READONLY, other server replies: still a store error
            msg = f"{self.url}: {what} refused: {type(e).__name__}: {redact_text(e, self._secret_url)}"
            logger.warning("redis %s", msg)
            raise StoreError(msg) from e

    def _k(self, key: str) -> str:
        return self.prefix + key

    async def put(self, key: str, data: bytes) -> None:
        await self._call("SET", lambda r: r.set(self._k(key), data))

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
                    pipe.set(self._k(k), v)
                await pipe.execute()

        await self._call("pipelined SET", run)

    async def get_many(self, keys: Iterable[str]) -> list[bytes | None]:
        keys = [self._k(k) for k in keys]
        if not keys:
            return []
        return list(await self._call("MGET", lambda r: r.mget(keys)))

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
