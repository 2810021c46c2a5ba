"""The StorageBackend contract on every backend: memory, disk, redis, S3 (moto), NIXL."""

import os
import time

import pytest

from storage_backends import StoreUnavailable, open_backend

from stores import SilentServer, closed_port, has_module, need, run


def test_round_trip_range_batch_delete(any_url):
    payload = os.urandom(300_000)

    async def go():
        b = open_backend(any_url)
        try:
            assert await b.get("nope") is None
            assert await b.get_range("nope", 0, 10) is None
            assert not await b.exists("nope")
            await b.put("a/b@c%d:e=1,f", payload)  # key characters our keys use
            assert await b.exists("a/b@c%d:e=1,f")
            assert await b.get("a/b@c%d:e=1,f") == payload
            assert await b.get_range("a/b@c%d:e=1,f", 1000, 250_000) == payload[1000:250_000]
            assert await b.get_range("a/b@c%d:e=1,f", 299_990, 400_000) == payload[299_990:]
            assert await b.get_range("a/b@c%d:e=1,f", 5, 5) == b""
            await b.put("a/b@c%d:e=1,f", b"v2")  # overwrite replaces whole value
            assert await b.get("a/b@c%d:e=1,f") == b"v2"
            await b.put("empty", b"")
            assert await b.get("empty") == b""
            items = {f"k{i}": os.urandom(1000 + i) for i in range(20)}
            await b.put_many(items)
            got = await b.get_many(list(items) + ["missing"])
            assert got[:-1] == list(items.values()) and got[-1] is None
            assert await b.exists_many(["k0", "missing", "k19"]) == [True, False, True]
            await b.delete("k0")
            await b.delete("k0")  # deleting twice is fine
            assert await b.get("k0") is None and not await b.exists("k0")
            with pytest.raises(ValueError):
                await b.get_range("k1", 10, 5)
        finally:
            await b.close()

    run(go())


def test_two_clients_see_each_others_writes(any_url):
    async def go():
        a, b = open_backend(any_url), open_backend(any_url)
        try:
            await a.put("shared", b"hello")
            assert await b.get("shared") == b"hello"
        finally:
            await a.close()
            await b.close()

    run(go())


def test_disk_writes_are_atomic_and_leave_no_temp_files(disk_url, monkeypatch):
    from storage_backends.local_connector import DiskBackend

    async def go():
        b = open_backend(disk_url)
        await b.put("k", b"old" * 1000)
        real_replace = os.replace

        def crash(*a, **kw):
            raise OSError("disk full (simulated)")

        monkeypatch.setattr(os, "replace", crash)
        with pytest.raises(StoreUnavailable, match="disk full"):
            await b.put("k", b"new" * 1000)
        monkeypatch.setattr(os, "replace", real_replace)
        assert await b.get("k") == b"old" * 1000  # the complete old value survives
        assert not [f for f in os.listdir(b.root) if f.startswith(".tmp")]
        long_key = "x" * 500
        await b.put(long_key, b"1")
        assert await b.get(long_key) == b"1"

    assert isinstance(open_backend(disk_url), DiskBackend)
    run(go())


@pytest.mark.parametrize("kind", ["redis", "s3", "nixl"])
def test_server_down_raises_store_unavailable_quickly(kind):
    port = closed_port()
    url = {
        "redis": f"redis://127.0.0.1:{port}/0",
        "s3": f"s3://bucket/p?endpoint_url=http://127.0.0.1:{port}&region=us-east-1",
        "nixl": f"nixl://127.0.0.1:{port}",
    }[kind]
    need(has_module({"redis": "redis", "s3": "boto3", "nixl": "nixl"}[kind]), f"{kind} client not installed")
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")

    async def go():
        b = open_backend(url, timeout_s=2, connect_timeout_s=1)
        t = time.monotonic()
        with pytest.raises(StoreUnavailable) as e:
            await b.get("k")
        await b.close()
        return time.monotonic() - t, str(e.value)

    elapsed, msg = run(go(), timeout=30)
    assert elapsed < 5, f"took {elapsed:.1f}s to notice a closed port"
    assert str(port) in msg


@pytest.mark.parametrize("kind", ["redis", "s3", "nixl"])
def test_hung_server_times_out_as_store_unavailable(kind):
    need(has_module({"redis": "redis", "s3": "boto3", "nixl": "nixl"}[kind]), f"{kind} client not installed")
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    silent = SilentServer()
    url = {
        "redis": f"redis://127.0.0.1:{silent.port}/0",
        "s3": f"s3://bucket/p?endpoint_url=http://127.0.0.1:{silent.port}&region=us-east-1",
        "nixl": f"nixl://127.0.0.1:{silent.port}",
    }[kind]

    async def go():
        b = open_backend(url, timeout_s=0.5, connect_timeout_s=0.5)
        t = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await b.get("k")
        await b.close()
        return time.monotonic() - t

    try:
        elapsed = run(go(), timeout=30)
    finally:
        silent.close()
    assert elapsed < 5, f"a hung server blocked for {elapsed:.1f}s"
