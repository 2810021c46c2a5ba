"""DualCopyStore on every backend, plus its fault handling."""

import logging
import time

import pytest
import torch

from storage_backends import (
    CorruptObject,
    DualCopyStore,
    MissingObject,
    StorageBackend,
    StoreUnavailable,
    open_backend,
)
from storage_backends.keys import FULL

from net import TcpProxy
from stores import closed_port, random_kv, random_tokens, run

MODEL = "SmolLM2-135M"


def compressed_copies(seed=0):
    g = torch.Generator().manual_seed(seed)
    kivi = (
        {"bits": 4, "group": 32},
        [
            {
                "k_q": torch.randint(0, 255, (2, 600, 8), generator=g, dtype=torch.uint8),
                "k_scale": torch.randn(2, 600, 1, generator=g).to(torch.bfloat16),
                "v_q": torch.randint(-100, 100, (2, 600, 8), generator=g, dtype=torch.int16),
            }
            for _ in range(3)
        ],
    )
    snap = (
        {"keep": [0, 5, 9]},
        [
            {
                "k": torch.randn(2, 150, 16, generator=g).to(torch.float8_e4m3fn),
                "idx": torch.arange(150, dtype=torch.int64),
            }
            for _ in range(3)
        ],
    )
    return {"kivi:bits=4,group=32": kivi, "snapkv:ratio=4": snap}


def bits(t):
    return t.view(torch.uint8) if t.dtype.itemsize == 1 and t.dtype.is_floating_point else t


def assert_layers_equal(a, b):
    assert len(a) == len(b)
    for la, lb in zip(a, b):
        assert la.keys() == lb.keys()
        for name in la:
            assert la[name].dtype == lb[name].dtype
            assert torch.equal(bits(la[name]), bits(lb[name])), name


async def collect(store, tokens):
    return [(i, k, v) async for i, k, v in store.stream_full(tokens)]


def test_full_and_compressed_round_trip(any_url):
    tokens = random_tokens(600)
    kv = random_kv(3, 2, 600, 16, torch.bfloat16)
    comp = compressed_copies()

    async def go():
        async with DualCopyStore(any_url, MODEL, torch.bfloat16) as s:
            r = await s.put_prefix(tokens, kv, comp)
            assert (r.num_tokens, r.full_chunks_written, r.full_chunks_present) == (600, 3, 0)
            assert set(r.compressed_bytes) == set(comp)
            assert await s.lookup(tokens) == 600
            assert await s.lookup(tokens[:300]) == 256  # chunk-aligned
            assert await s.lookup(tokens + [1] * 100) == 512  # stored partial chunk != longer chunk
            assert await s.lookup(random_tokens(600, seed=9)) == 0
            got = await collect(s, tokens)
            assert [i for i, _, _ in got] == [0, 1, 2]
            for i, k, v in got:
                assert torch.equal(k, kv[i]["k"]) and torch.equal(v, kv[i]["v"])
            for spec, (meta, layers) in comp.items():
                assert await s.has_compressed(tokens, spec)
                meta2, layers2 = await s.get_compressed(tokens, spec)
                assert meta2 == meta
                assert_layers_equal(layers, layers2)
            assert not await s.has_compressed(tokens, "kivi:bits=2,group=32")
            assert await s.get_compressed(tokens, "kivi:bits=2,group=32") is None
            assert await s.get_compressed(tokens[:512], "snapkv:ratio=4") is None  # exact prefix only
            full512 = await s.get_full(tokens[:512])
            assert torch.equal(full512[1][0], kv[1]["k"][:, :512])
            again = await s.put_prefix(tokens, kv, comp)  # idempotent: nothing rewritten
            assert (again.full_chunks_written, again.full_chunks_present) == (0, 3)

    run(go())


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float8_e4m3fn, torch.uint8])
def test_full_copy_dtypes(memory_url, dtype):
    tokens = random_tokens(300, seed=1)
    kv = random_kv(2, 3, 300, 8, torch.float32)
    kv = [{n: (t * 10).to(dtype) for n, t in layer.items()} for layer in kv]

    async def go():
        async with DualCopyStore(memory_url, MODEL, dtype, chunk_size=128) as s:
            await s.put_prefix(tokens, kv)
            got = await collect(s, tokens)
            assert len(got) == 2
            for i, k, v in got:
                assert k.dtype == v.dtype == dtype
                assert torch.equal(bits(k), bits(kv[i]["k"])) and torch.equal(bits(v), bits(kv[i]["v"]))

    run(go())


def test_prefix_sharing_reuses_chunks(memory_url):
    tokens = random_tokens(1024)
    kv = random_kv(2, 2, 1024, 8, torch.float16)

    async def go():
        async with DualCopyStore(memory_url, MODEL, torch.float16) as s:
            await s.put_prefix(tokens[:512], [{n: t[:, :512] for n, t in layer.items()} for layer in kv])
            r = await s.put_prefix(tokens, kv)
            assert (r.full_chunks_present, r.full_chunks_written) == (2, 2)
            got = await s.get_full(tokens)
            assert torch.equal(got[1][1], kv[1]["v"])

    run(go())


def test_put_prefix_rejects_bad_input(memory_url):
    async def go():
        async with DualCopyStore(memory_url, MODEL, torch.float16) as s:
            with pytest.raises(ValueError, match="tokens"):
                await s.put_prefix(list(range(10)), random_kv(1, 1, 9, 4, torch.float16))
            with pytest.raises(ValueError, match="'k' and 'v'"):
                await s.put_prefix(list(range(10)), [{"k": torch.zeros(1, 10, 4)}])
            with pytest.raises(ValueError, match="spec"):
                await s.put_prefix(list(range(10)), compressed={"bad spec": ({}, [])})
            with pytest.raises(ValueError):
                await s.put_prefix([], random_kv(1, 1, 0, 4, torch.float16))

    run(go())


class CrashingWriter(StorageBackend):
    """Passes writes through until a write of the given kind ('manifest' or
    'payload'), where the writer 'dies'; writes after that are lost too."""

    def __init__(self, inner, crash_on="manifest"):
        self.inner, self.url, self.crash_on, self.dead = inner, inner.url, crash_on, False

    async def put(self, key, data):
        kind = "payload" if "@blob%" in key else "manifest"
        if self.dead or kind == self.crash_on:
            self.dead = True
            raise StoreUnavailable(f"writer died writing a {kind}")
        await self.inner.put(key, data)

    async def put_many(self, items):
        for k, v in items.items():
            await self.put(k, v)

    async def get(self, key):
        return await self.inner.get(key)

    async def get_range(self, key, start, end):
        return await self.inner.get_range(key, start, end)

    async def exists(self, key):
        return await self.inner.exists(key)

    async def delete(self, key):
        await self.inner.delete(key)


@pytest.mark.parametrize("crash_on", ["payload", "manifest"])
def test_writer_crash_leaves_nothing_visible(memory_url, crash_on):
    """Whichever write dies, readers see no copy at all (manifests go last)."""
    tokens = random_tokens(600)
    kv = random_kv(2, 2, 600, 8, torch.float16)
    spec = "snapkv:ratio=4"

    async def go():
        writer = DualCopyStore(
            CrashingWriter(open_backend(memory_url), crash_on), MODEL, torch.float16, write_batch_bytes=1
        )  # one chunk per batch
        with pytest.raises(StoreUnavailable):
            await writer.put_prefix(tokens, kv)
        writer.backend.dead = False
        with pytest.raises(StoreUnavailable):
            await writer.put_prefix(tokens, compressed={spec: compressed_copies()[spec]})
        reader = DualCopyStore(memory_url, MODEL, torch.float16)
        assert await reader.lookup(tokens) == 0
        assert not await reader.has_compressed(tokens, spec)
        assert await reader.get_compressed(tokens, spec) is None

    run(go())


def test_payload_without_manifest_is_invisible_and_old_copy_survives(any_url):
    tokens = random_tokens(300)
    kv = random_kv(2, 2, 300, 8, torch.float16)
    comp = compressed_copies()
    spec = "kivi:bits=4,group=32"
    new_meta, new_layers = compressed_copies(seed=5)[spec]

    async def go():
        raw = open_backend(any_url)
        crashing = DualCopyStore(CrashingWriter(raw), MODEL, torch.float16)
        with pytest.raises(StoreUnavailable):
            await crashing.put_prefix(tokens, kv)
        with pytest.raises(StoreUnavailable):
            await crashing.put_prefix(tokens, compressed={spec: comp[spec]})
        reader = DualCopyStore(any_url, MODEL, torch.float16)
        assert await reader.lookup(tokens) == 0
        assert not await reader.has_compressed(tokens, spec)
        assert await reader.get_compressed(tokens, spec) is None
        with pytest.raises(MissingObject):
            await collect(reader, tokens)
        # a complete write, then a crashed overwrite: readers keep the complete copy
        await reader.put_prefix(tokens, kv, {spec: comp[spec]})
        with pytest.raises(StoreUnavailable):
            await crashing.put_prefix(tokens, compressed={spec: (new_meta, new_layers)}, overwrite=True)
        meta, layers = await reader.get_compressed(tokens, spec)
        assert meta == comp[spec][0]
        assert_layers_equal(layers, comp[spec][1])
        await reader.put_prefix(tokens, compressed={spec: (new_meta, new_layers)})  # real overwrite
        meta, layers = await reader.get_compressed(tokens, spec)
        assert_layers_equal(layers, new_layers)
        await reader.close()

    run(go())


async def _payload_keys(store, tokens, spec):
    """Payload keys of a copy, read from its manifests."""
    from storage_backends.manifest import Manifest

    chunks = store.keys.chunks(tokens)
    keys = [c.copy(spec) for c in (chunks if spec == FULL else chunks[-1:])]
    return [Manifest.from_bytes(await store.backend.get(k), k) for k in keys]


def test_corrupt_byte_is_detected_per_layer(any_url, caplog):
    tokens = random_tokens(512)
    kv = random_kv(3, 2, 512, 8, torch.float32)
    spec = "snapkv:ratio=4"
    comp = {spec: compressed_copies()[spec]}

    async def go():
        async with DualCopyStore(any_url, MODEL, torch.float32) as s:
            await s.put_prefix(tokens, kv, comp)
            full = await _payload_keys(s, tokens, FULL)
            m = full[1]  # chunk 1: flip one byte inside layer 1
            data = bytearray(await s.backend.get(m.payload_key))
            data[m.layers[1].offset + m.layers[1].length // 2] ^= 0x40
            await s.backend.put(m.payload_key, bytes(data))
            seen = []
            with pytest.raises(CorruptObject, match="layer 1"):
                async for i, _k, _v in s.stream_full(tokens):
                    seen.append(i)
            assert seen == [0]  # layer 0 was verified and delivered before the bad one
            (cm,) = await _payload_keys(s, tokens, spec)
            data = bytearray(await s.backend.get(cm.payload_key))
            data[-1] ^= 1
            await s.backend.put(cm.payload_key, bytes(data))
            with pytest.raises(CorruptObject, match="checksum"):
                await s.get_compressed(tokens, spec)

    with caplog.at_level(logging.WARNING, logger="vericache.store"):
        run(go())
    assert any("checksum" in r.getMessage() for r in caplog.records if r.name == "vericache.store")


def test_truncated_and_missing_payloads(any_url):
    tokens = random_tokens(300)
    kv = random_kv(2, 2, 300, 8, torch.float16)
    spec = "kivi:bits=4,group=32"
    comp = {spec: compressed_copies()[spec]}

    async def go():
        async with DualCopyStore(any_url, MODEL, torch.float16) as s:
            await s.put_prefix(tokens, kv, comp)
            full = await _payload_keys(s, tokens, FULL)
            (cm,) = await _payload_keys(s, tokens, spec)
            data = await s.backend.get(full[1].payload_key)
            await s.backend.put(full[1].payload_key, data[:-10])  # truncated last layer
            with pytest.raises(CorruptObject, match="truncated"):
                await collect(s, tokens)
            data = await s.backend.get(cm.payload_key)
            await s.backend.put(cm.payload_key, data[: len(data) // 2])
            with pytest.raises(CorruptObject, match="truncated"):
                await s.get_compressed(tokens, spec)
            await s.backend.delete(cm.payload_key)  # manifest left, payload evicted
            with pytest.raises(MissingObject):
                await s.get_compressed(tokens, spec)
            await s.backend.delete(full[0].payload_key)
            with pytest.raises(MissingObject):
                await collect(s, tokens)
            with pytest.raises(MissingObject, match="not stored"):
                await collect(s, random_tokens(300, seed=4))  # never stored

    run(go())


def test_other_model_or_dtype_never_matches(any_url):
    tokens = random_tokens(300)
    kv = random_kv(2, 2, 300, 8, torch.bfloat16)
    spec = "snapkv:ratio=4"

    async def go():
        async with DualCopyStore(any_url, MODEL, torch.bfloat16) as s:
            await s.put_prefix(tokens, kv, {spec: compressed_copies()[spec]})
            assert await s.lookup(tokens) == 300
        for model, dtype in ((MODEL, torch.float16), ("other-model", torch.bfloat16)):
            async with DualCopyStore(any_url, model, dtype) as other:
                assert await other.lookup(tokens) == 0
                assert not await other.has_compressed(tokens, spec)
                assert await other.get_compressed(tokens, spec) is None
                with pytest.raises(MissingObject):
                    await collect(other, tokens)

    run(go())


def test_compressor_specs_of_one_prefix_coexist(any_url):
    tokens = random_tokens(256)
    copies = compressed_copies()

    async def go():
        async with DualCopyStore(any_url, MODEL, torch.float16) as s:
            for spec, copy in copies.items():  # separate writes of each spec
                await s.put_prefix(tokens, compressed={spec: copy})
            for spec, (meta, layers) in copies.items():
                meta2, layers2 = await s.get_compressed(tokens, spec)
                assert meta2 == meta
                assert_layers_equal(layers, layers2)
            assert await s.lookup(tokens) == 0  # no full copy was written

    run(go())


def test_bandwidth_limit_slows_stream_and_layers_arrive_progressively(memory_url):
    tokens = random_tokens(512)
    kv = random_kv(6, 2, 512, 64, torch.float32)  # 6 layers x 512 KiB
    total = sum(t.numel() * 4 for layer in kv for t in layer.values())
    rate = 4_000_000

    async def timed(store):
        t0 = time.monotonic()
        stamps = [time.monotonic() - t0 async for _ in store.stream_full(tokens)]
        return stamps

    async def go():
        async with DualCopyStore(memory_url, MODEL, torch.float32) as s:
            await s.put_prefix(tokens, kv)
            fast = await timed(s)
        async with DualCopyStore(memory_url, MODEL, torch.float32, bandwidth_bytes_per_s=rate) as slow_store:
            slow = await timed(slow_store)
        return fast, slow

    fast, slow = run(go())
    expected = total / rate  # ~0.79 s
    assert slow[-1] >= 0.8 * expected, (slow, expected)
    assert slow[-1] < 3 * expected + 2
    assert slow[-1] > fast[-1] + 0.5 * expected
    assert slow[0] < 0.5 * slow[-1]  # layer 0 is usable long before the last layer arrives


def test_redis_killed_mid_stream_raises_store_unavailable(private_redis):
    tokens = random_tokens(512)
    kv = random_kv(8, 2, 512, 32, torch.float32)

    async def go():
        async with DualCopyStore(private_redis.url, MODEL, torch.float32) as w:
            await w.put_prefix(tokens, kv)
        r = DualCopyStore(
            private_redis.url, MODEL, torch.float32, bandwidth_bytes_per_s=2_000_000, timeout_s=2, connect_timeout_s=1
        )
        seen = []
        t = time.monotonic()
        with pytest.raises(StoreUnavailable):
            async for i, _k, _v in r.stream_full(tokens):
                seen.append(i)
                if i == 0:
                    private_redis.kill()
        await r.close()
        return seen, time.monotonic() - t

    seen, elapsed = run(go(), timeout=60)
    assert seen and seen[0] == 0 and len(seen) < 8
    assert elapsed < 10


@pytest.mark.parametrize("kind", ["redis", "s3", "nixl"])
def test_connection_dropped_mid_stream_through_proxy(kind, request):
    from urllib.parse import urlsplit

    url = request.getfixturevalue(f"{kind}_url")
    if kind in ("redis", "nixl"):  # nixl: the control channel drops, data moves by UCX
        parts = urlsplit(url)
        proxy = TcpProxy(parts.hostname, parts.port)
        proxied = url.replace(f":{parts.port}", f":{proxy.port}", 1)
    else:
        endpoint = urlsplit(url.split("endpoint_url=")[1].split("&")[0])
        proxy = TcpProxy(endpoint.hostname, endpoint.port)
        proxied = url.replace(f":{endpoint.port}", f":{proxy.port}")
    tokens = random_tokens(512)
    kv = random_kv(8, 2, 512, 32, torch.float32)

    async def go():
        async with DualCopyStore(url, MODEL, torch.float32) as w:
            await w.put_prefix(tokens, kv)
        r = DualCopyStore(
            proxied, MODEL, torch.float32, bandwidth_bytes_per_s=2_000_000, timeout_s=2, connect_timeout_s=1
        )
        seen = []
        with pytest.raises(StoreUnavailable):
            async for i, _k, _v in r.stream_full(tokens):
                seen.append(i)
                if i == 0:
                    proxy.close()
        await r.close()
        return seen

    try:
        seen = run(go(), timeout=60)
    finally:
        proxy.close()
    assert seen == [0] or (seen and len(seen) < 8)
    assert proxy.bytes_relayed > 0


def test_store_down_surfaces_as_store_unavailable():
    port = closed_port()

    async def go():
        s = DualCopyStore(f"redis://127.0.0.1:{port}/0", MODEL, torch.float16, timeout_s=1, connect_timeout_s=0.5)
        for call in (
            s.lookup(list(range(10))),
            s.get_compressed(list(range(10)), "kivi:bits=4"),
            collect(s, list(range(10))),
        ):
            with pytest.raises(StoreUnavailable):
                await call
        await s.close()

    pytest.importorskip("redis")
    run(go(), timeout=30)
