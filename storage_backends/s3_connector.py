"""s3://bucket/prefix store (boto3 in worker threads); works with any S3 endpoint."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import AsyncIterator, Iterable, Mapping, Sequence

from .base import (
    BackendOptions,
    CorruptObject,
    ObjectInfo,
    StorageBackend,
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

_MISSING_CODES = {"404", "NoSuchKey", "NotFound"}


class S3Backend(StorageBackend):
    """One S3 object per key under s3://bucket/prefix; PUT is atomic per object.

    Options (kwargs or URL query): endpoint_url, region, timeout_s,
    connect_timeout_s, max_attempts (1 = no retries), max_concurrency,
    create_bucket (default 1), max_object_bytes (default 1 GiB: a whole-object GET of anything
    bigger fails with CorruptObject before its body is read; range reads are bounded by their range),
    ttl_s (an object last written or refreshed longer ago than this, by its LastModified, reads as absent;
    touch refreshes it with a server-side copy onto itself, at most once per ttl_s / 4 from this process;
    S3 deletes nothing by itself: `vericache store evict --older-than` or a lifecycle rule does).
    Credentials come from the usual AWS environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, profiles,
    ...), never from the URL.
    """

    def __init__(self, url: str, **opts):
        shown = redact_url(url)
        parts = split_url(url)
        if not parts.netloc:
            raise ValueError(f"bad store URL {shown!r}: expected s3://bucket/prefix")
        if "@" in parts.netloc:
            raise ValueError(f"bad store URL {shown!r}: credentials come from the AWS environment, not the URL")
        opts = {**query_options(url), **opts}
        self.options = BackendOptions.pop_from(opts)
        self.bucket = parts.netloc
        self.prefix = parts.path.strip("/")
        self.endpoint_url = opts.pop("endpoint_url", None) or None
        self.region = opts.pop("region", None) or opts.pop("region_name", None)
        self.max_attempts = int(opts.pop("max_attempts", 1))
        self.max_concurrency = int(opts.pop("max_concurrency", 8))
        self.create_bucket = str(opts.pop("create_bucket", "1")).lower() in ("1", "true", "yes")
        self.max_object_bytes = int(opts.pop("max_object_bytes", 1 << 30))
        self.ttl_s = pop_optional(opts, "ttl_s")
        self.refreshes = self.ttl_s is not None
        self._fresh: dict[str, float] = {}  # key -> when this process last wrote or refreshed it (monotonic)
        if opts:
            raise unknown_options(opts, url)
        self.url = shown
        self._secret_url = url
        self._client = None
        self._lock = threading.Lock()
        self._bucket_ready = False
        self._sem: asyncio.Semaphore | None = None

    # -- boto3 plumbing (runs in worker threads) ---------------------------
    def _s3(self):
        with self._lock:
            if self._client is None:
                import boto3
                from botocore.config import Config

                cfg = Config(
                    connect_timeout=self.options.connect_timeout_s,
                    read_timeout=self.options.timeout_s,
                    retries={"max_attempts": self.max_attempts, "mode": "standard"},
                    max_pool_connections=max(10, self.max_concurrency),
                    s3={"addressing_style": "path"} if self.endpoint_url else {},
                    request_checksum_calculation="when_required",
                    response_checksum_validation="when_required",
                )
                self._client = boto3.session.Session().client(
                    "s3", endpoint_url=self.endpoint_url, region_name=self.region, config=cfg
                )
            client = self._client
        if self.create_bucket and not self._bucket_ready:
            self._ensure_bucket(client)
        return client

    def _ensure_bucket(self, client) -> None:
        from botocore.exceptions import ClientError

        try:
            client.head_bucket(Bucket=self.bucket)
        except ClientError as e:
            if _code(e) not in _MISSING_CODES | {"NoSuchBucket"}:
                raise
            kwargs = {"Bucket": self.bucket}
            if self.region and self.region != "us-east-1":
                kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self.region}
            try:
                client.create_bucket(**kwargs)
                logger.info("created bucket %s on %s", self.bucket, self.endpoint_url or "AWS")
            except ClientError as e2:
                if _code(e2) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise
        self._bucket_ready = True

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _put(self, key: str, data: bytes) -> None:
        self._s3().put_object(Bucket=self.bucket, Key=self._key(key), Body=data)
        self._mark_fresh(key)

    def _mark_fresh(self, key: str) -> None:
        if self.ttl_s is not None:
            if len(self._fresh) > 100_000:
                self._fresh.clear()
            self._fresh[key] = time.monotonic()

    def _expired(self, resp) -> bool:
        modified = resp.get("LastModified")
        return self.ttl_s is not None and modified is not None and modified.timestamp() < time.time() - self.ttl_s

    def _refresh(self, key: str) -> None:
        """A server-side copy of the object onto itself: its LastModified is now (no bytes cross the link)."""
        from botocore.exceptions import ClientError

        k = self._key(key)
        try:
            self._s3().copy_object(
                Bucket=self.bucket, Key=k, CopySource={"Bucket": self.bucket, "Key": k}, MetadataDirective="REPLACE"
            )
        except ClientError as e:
            if _code(e) not in _MISSING_CODES:
                raise
            return
        self._mark_fresh(key)

    def _list(self) -> list[ObjectInfo]:
        start = f"{self.prefix}/" if self.prefix else ""
        out = []
        for page in self._s3().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=start):
            for o in page.get("Contents", ()):
                out.append(ObjectInfo(o["Key"][len(start) :], int(o["Size"]), o["LastModified"].timestamp()))
        return out

    def _get(self, key: str, start: int | None = None, end: int | None = None) -> bytes | None:
        from botocore.exceptions import ClientError

        s3 = self._s3()
        kwargs = {"Bucket": self.bucket, "Key": self._key(key)}
        limit = self.max_object_bytes
        if start is not None:
            if end <= start:  # empty range: only existence matters
                return b"" if self._exists(key) else None
            kwargs["Range"] = f"bytes={start}-{end - 1}"
            limit = end - start
        try:
            resp = s3.get_object(**kwargs)
        except ClientError as e:
            code = _code(e)
            if code in _MISSING_CODES:
                return None
            if code in ("InvalidRange", "416"):  # start past the end of the object
                return b""
            raise
        body = resp["Body"]
        expected = resp.get("ContentLength")
        try:
            if self._expired(resp):
                return None
            if expected is not None and expected > limit:  # checked before a byte of the body is read
                raise CorruptObject(f"{self.url}: object {key!r} is {expected} bytes, more than the {limit} expected")
            data = body.read(None if expected is not None else limit + 1)
        finally:
            body.close()
        if len(data) > limit:
            raise CorruptObject(f"{self.url}: object {key!r} is over {limit} bytes")
        if expected is not None and len(data) != expected:
            raise ConnectionError(f"short read: {len(data)} of {expected} bytes")
        return data

    def _exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            return not self._expired(self._s3().head_object(Bucket=self.bucket, Key=self._key(key)))
        except ClientError as e:
            if _code(e) in _MISSING_CODES:
                return False
            raise

    def _delete(self, key: str) -> None:
        self._s3().delete_object(Bucket=self.bucket, Key=self._key(key))

    # -- async API -----------------------------------------------------------
    async def _run(self, what: str, key: str, fn, *args):
        from botocore.exceptions import BotoCoreError, ClientError

        if self._sem is None:
            self._sem = asyncio.Semaphore(self.max_concurrency)
        limit = (self.options.connect_timeout_s + self.options.timeout_s) * self.max_attempts + 5
        async with self._sem:
            try:
                return await asyncio.wait_for(asyncio.to_thread(fn, *args), limit)
            except (BotoCoreError, ClientError, OSError, asyncio.TimeoutError, ConnectionError) as e:
                msg = f"{self.url}: {what} {key!r} failed: {type(e).__name__}: {redact_text(e, self._secret_url)}"
                logger.warning("s3 %s", msg)
                raise StoreUnavailable(msg) from e
            except CorruptObject as e:
                logger.warning("s3 %s", e)
                raise
            except Exception as e:  # urllib3 errors surfacing from a dropped body read
                if type(e).__module__.startswith(("urllib3", "http.client")):
                    msg = f"{self.url}: {what} {key!r} failed: {type(e).__name__}: {redact_text(e, self._secret_url)}"
                    logger.warning("s3 %s", msg)
                    raise StoreUnavailable(msg) from e
                raise

    async def put(self, key: str, data: bytes) -> None:
        await self._run("PUT", key, self._put, key, bytes(data))

    async def get(self, key: str) -> bytes | None:
        return await self._run("GET", key, self._get, key)

    async def get_range(self, key: str, start: int, end: int) -> bytes | None:
        check_range(start, end)
        return await self._run("GET range", key, self._get, key, start, end)

    async def exists(self, key: str) -> bool:
        return await self._run("HEAD", key, self._exists, key)

    async def delete(self, key: str) -> None:
        await self._run("DELETE", key, self._delete, key)

    async def touch(self, keys: Sequence[str]) -> None:
        if self.ttl_s is None:
            return
        now = time.monotonic()
        due = [k for k in dict.fromkeys(keys) if now - self._fresh.get(k, -1e18) > self.ttl_s / 4]
        await asyncio.gather(*(self._run("COPY", k, self._refresh, k) for k in due))

    async def scan(self) -> AsyncIterator[ObjectInfo]:
        for o in await self._run("LIST", self.prefix, self._list):
            yield o

    async def put_many(self, items: Mapping[str, bytes]) -> None:
        await asyncio.gather(*(self.put(k, v) for k, v in items.items()))

    async def get_many(self, keys: Iterable[str]) -> list[bytes | None]:
        return list(await asyncio.gather(*(self.get(k) for k in keys)))

    async def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception as e:
                logger.debug("s3 close on %s: %s", self.url, e)


def _code(error) -> str:
    return str(error.response.get("Error", {}).get("Code", ""))
