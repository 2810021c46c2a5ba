"""redis+cluster://host:port,host:port,... : a Redis Cluster (redis-py's cluster client, asyncio).

Every key of one chunk (its full copy's manifest and payload, and the compressed copies of the prefix that
ends there: inventory.group_of) carries the same hash tag, ``{<16 hex of a hash of the chunk's base
key>}``, so they live in one hash slot, on one shard: a reader never finds a manifest on one shard whose
payload sits (or was evicted) on another, and a shard that fails or evicts takes whole chunks with it.
The nodes listed are where the client starts; it learns the rest of the cluster from them. Options as
redis:// (prefix, ttl_s, timeouts, max_connections: per node); the database is always 0.
"""

from __future__ import annotations

import hashlib
from urllib.parse import unquote

from .base import split_url
from .inventory import group_of
from .redis_connector import RedisBackend


def parse_hosts(netloc: str, bad) -> tuple[str | None, str | None, list[tuple[str, int]]]:
    """(user, password, [(host, port), ...]) of 'user:password@h1:p1,h2:p2' (the password percent-decoded).
    bad(why) makes the ValueError (it shows the URL redacted)."""
    userinfo, at, hostlist = netloc.rpartition("@")
    user = password = None
    if at:  # as redis-py reads redis://user:password@host (no ':': a user name alone)
        name, colon, secret = userinfo.partition(":")
        user, password = unquote(name) or None, unquote(secret) if colon else None
    hosts = []
    for item in hostlist.split(","):
        try:
            parts = split_url("//" + item.strip())
            host, port = parts.hostname, parts.port
        except ValueError:
            host = port = None
        if not host or not port:
            raise bad(f"host {item.strip()!r} is not host:port")
        hosts.append((host, port))
    return user, password, hosts


class RedisClusterBackend(RedisBackend):
    USAGE = "redis+cluster://[[user]:password@]host:port[,host:port...][/0]"

    def _parse(self, url: str) -> None:
        parts = split_url(url)
        if parts.path not in ("", "/", "/0") or parts.fragment:
            raise self._bad("a cluster has database 0 only")
        self._user, self._password, self._nodes = parse_hosts(parts.netloc, self._bad)

    def _take_options(self, opts: dict) -> None:
        if "{" in self.prefix or "}" in self.prefix:
            raise ValueError(f"prefix={self.prefix!r}: a cluster store's prefix cannot hold '{{' or '}}' (hash tags)")

    def _make_client(self):
        from redis.asyncio.cluster import ClusterNode, RedisCluster

        kw = self._connection_kwargs()
        return RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in self._nodes],
            username=self._user,
            password=self._password,
            socket_timeout=kw["socket_timeout"],
            socket_connect_timeout=kw["socket_connect_timeout"],
            retry=kw["retry"],
            max_connections=kw["max_connections"],
        )

    def _k(self, key: str) -> str:
        tag = hashlib.blake2b(group_of(key).encode(), digest_size=8).hexdigest()
        return f"{self.prefix}{{{tag}}}{key}"

    def _unk(self, name: bytes) -> str | None:
        key = super()._unk(name)
        if key is None or not key.startswith("{"):
            return None
        return key.partition("}")[2]

    def _mget(self, r, keys: list[str]):
        return r.mget_nonatomic(keys)  # keys of several slots
