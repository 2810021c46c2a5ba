"""redis+sentinel://host:port,host:port,.../service[/db] : the master of a Redis Sentinel service.

The listed Sentinels name the service's current master; the client connects to it, and after a failover
(the master down, a replica promoted) its next connection asks them again, so hits resume on the new
master. A call in flight when the master goes is a StoreUnavailable: the reader recomputes, exactly as for
any store fault. The URL's password is the master's (and its replicas'); the Sentinels are asked without
one. Options as redis:// (prefix, ttl_s, timeouts, max_connections).
"""

from __future__ import annotations

from .base import split_url
from .redis_cluster import parse_hosts
from .redis_connector import RedisBackend


class RedisSentinelBackend(RedisBackend):
    USAGE = "redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db]"

    def _parse(self, url: str) -> None:
        parts = split_url(url)
        path = [p for p in parts.path.split("/") if p]
        if parts.fragment or not 1 <= len(path) <= 2 or (len(path) == 2 and not path[1].isdigit()):
            raise self._bad("name the service (and the database)")
        self.service = path[0]
        self.db = int(path[1]) if len(path) == 2 else 0
        self._user, self._password, self._sentinels = parse_hosts(parts.netloc, self._bad)

    def _make_client(self):
        from redis.asyncio.sentinel import Sentinel

        kw = self._connection_kwargs()
        sentinel = Sentinel(
            self._sentinels,
            sentinel_kwargs={
                "socket_timeout": kw["socket_timeout"],
                "socket_connect_timeout": kw["socket_connect_timeout"],
                "retry": kw["retry"],
            },
        )
        self._sentinel = sentinel
        return sentinel.master_for(
            self.service, db=self.db, username=self._user, password=self._password, check_connection=False, **kw
        )

    async def close(self) -> None:
        await super().close()
        sentinel, self._sentinel = getattr(self, "_sentinel", None), None
        for s in getattr(sentinel, "sentinels", ()) if sentinel is not None else ():
            try:
                await s.aclose()
            except Exception:  # noqa: BLE001 - closing a dead connection must not raise
                pass
