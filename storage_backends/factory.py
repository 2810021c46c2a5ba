"""open_backend: the store a URL names. Its connectors (local, redis, redis+cluster, redis+sentinel, s3, nixl)
subclass base.StorageBackend; each is imported only when its scheme is opened, with its client."""

from __future__ import annotations

from .base import StorageBackend
from .credentials import redact_url


def open_backend(url: str, **opts) -> StorageBackend:
    """Open the backend named by url's scheme.

    local://[name] (process memory), local:///dir[?max_bytes=N] (disk), redis://host:port/db (rediss://: TLS),
    redis+cluster://host:port,host:port,... (Redis Cluster), redis+sentinel://host:port,.../service[/db],
    s3://bucket/prefix?endpoint_url=...&region=..., nixl://host:port. Redis and S3 take ttl_s.
    Options (timeout_s, connect_timeout_s, ...) come from **opts or the query. Errors name the URL
    through redact_url: a password never appears in them.
    """
    if not isinstance(url, str) or "://" not in url:
        raise ValueError(f"bad store URL {redact_url(url)!r}: expected scheme://...")
    scheme = url.split("://", 1)[0].lower()
    if scheme == "local":
        from .local_connector import open_local

        return open_local(url, **opts)
    if scheme in ("redis", "rediss"):
        from .redis_connector import RedisBackend

        return RedisBackend(url, **opts)
    if scheme == "redis+cluster":
        from .redis_cluster import RedisClusterBackend

        return RedisClusterBackend(url, **opts)
    if scheme == "redis+sentinel":
        from .redis_sentinel import RedisSentinelBackend

        return RedisSentinelBackend(url, **opts)
    if scheme == "s3":
        from .s3_connector import S3Backend

        return S3Backend(url, **opts)
    if scheme == "nixl":
        from .nixl_connector import NixlBackend

        return NixlBackend(url, **opts)
    raise ValueError(
        f"bad store URL {redact_url(url)!r}: unknown scheme {redact_url(scheme)!r} (expected local, redis, rediss, redis+cluster, redis+sentinel, s3 or nixl)"
    )
