"""Issue 28, case 3: the LMCache legacy plugin returned objects with a valid CRC and exactly the bytes
their shapes need, but a rank or shape that is not the model's (`[1,2,3]`, `[2,256,3,64,4]`), and a
two-tensor object whose `.tensor` raises; and it read a junk object of any size in full. Now the shapes,
dtypes and memory format must be LMCache's own chunk layout (only the token dim may be shorter: a
partial chunk), and a get reads at most a full chunk plus the header bound. Driven by LMCache's own
StorageManager (CPU), an in-memory store."""

from __future__ import annotations

import asyncio
import json
import logging
import struct

from test_storage_lmcache import (
    _lmcache,  # noqa: F401 - its autouse skip: no LMCache, no test
    assert_each_is_a_miss,
    close_within,
    connector_of,
    craft,
    get_now,
    make_manager,
    put_chunks,
    put_raw,
    stored,
)

from storage_backends.base import StorageBackend

from net import wait_for


def test_objects_of_the_wrong_layout_are_misses(memory_url, caplog):
    from lmcache.v1.memory_management import MemoryFormat

    manager, meta = make_manager(memory_url)  # chunks of [2, 4, 256, 192] float16 (kv_shape 4, 2, 256, 3, 64)
    try:
        connector = connector_of(manager)
        keys, ref = put_chunks(manager, meta, n=1)
        key_str = keys[0].to_string()
        good = run_until(lambda: stored(memory_url, key_str))
        hlen = struct.unpack_from("<I", good, 4)[0]
        raw, fmt = good[8 + hlen :], json.loads(good[8 : 8 + hlen])["fmt"]
        other_fmt = next(f.value for f in MemoryFormat if f.value != fmt)
        assert list(meta.get_shapes()[0]) == [2, 4, 256, 192] and len(raw) == 2 * 4 * 256 * 192 * 2
        half = raw[: len(raw) // 2]
        cases = {  # each with a valid crc and exactly the bytes its shapes need
            "rank 3, 12 bytes": craft(good, raw=b"\0" * 12, length=12, shapes=[[1, 2, 3]]),
            "kv_shape order": craft(good, shapes=[[2, 256, 3, 64, 4]]),
            "flat": craft(good, shapes=[[2 * 4 * 256 * 192]]),
            "dims swapped": craft(good, shapes=[[2, 4, 192, 256]]),
            "two tensors": craft(good, shapes=[[2, 4, 128, 192]] * 2, dtypes=["float16"] * 2),
            "other layers": craft(good, raw=half, length=len(half), shapes=[[2, 2, 256, 192]]),
            "other format": craft(good, fmt=other_fmt),
        }
        assert_each_is_a_miss(caplog, memory_url, connector, keys[0], cases)
        # a partial chunk (fewer tokens, LMCache's own layout otherwise) is served, as are its bytes
        put_raw(memory_url, key_str, craft(good, raw=half, length=len(half), shapes=[[2, 4, 128, 192]]))
        got = get_now(connector, keys[0])
        assert got is not None and list(got.tensor.shape) == [2, 4, 128, 192]
        assert bytes(got.byte_array)[: len(half)] == bytes(half)
        got.ref_count_down()
    finally:
        close_within(manager)


class Counting(StorageBackend):
    """A backend that counts the bytes it hands back."""

    def __init__(self, inner: StorageBackend):
        self.inner, self.read = inner, 0

    def _count(self, data):
        self.read += len(data or b"")
        return data

    async def get(self, key):
        return self._count(await self.inner.get(key))

    async def get_range(self, key, start, end):
        return self._count(await self.inner.get_range(key, start, end))

    async def get_many(self, keys):
        return [self._count(d) for d in await self.inner.get_many(keys)]

    async def put(self, key, data):
        await self.inner.put(key, data)

    async def exists(self, key):
        return await self.inner.exists(key)

    async def delete(self, key):
        await self.inner.delete(key)


def test_a_huge_object_is_not_read_whole(memory_url, caplog):
    from storage_backends import open_backend

    manager, meta = make_manager(memory_url)
    try:
        connector = connector_of(manager)
        keys, _ = put_chunks(manager, meta, n=2)
        run_until(lambda: all(stored(memory_url, k.to_string()) for k in keys))
        junk = b"VCL2" + struct.pack("<I", 2) + b"{}" + b"\0" * (64 << 20)  # 64 MiB
        for k in keys:
            put_raw(memory_url, k.to_string(), junk)
        connector._backend = counting = Counting(open_backend(memory_url))
        bound = 8 + (64 << 10) + connector.full_chunk_size_bytes
        with caplog.at_level(logging.WARNING):
            assert get_now(connector, keys[0]) is None
            assert counting.read <= bound + 1
            got = asyncio.run_coroutine_threadsafe(connector.batched_get(keys), connector.loop).result(20)
        assert got == [None, None] and counting.read <= 3 * (bound + 1)
        assert any(f"over {bound} bytes" in r.getMessage() for r in caplog.records)
    finally:
        close_within(manager)


def run_until(get, seconds: float = 10):
    return wait_for(get, timeout_s=seconds, what=lambda: "the put never landed")
