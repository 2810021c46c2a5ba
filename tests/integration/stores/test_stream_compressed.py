"""DualCopyStore.stream_compressed: compressed copies layer by layer, one after the other, on every backend;
each layer checked as it arrives, the header with the whole payload, misses and faults as the store's."""

import contextlib
import logging
import time

import pytest
import torch

from storage_backends import CorruptObject, DualCopyStore, MissingObject
from storage_backends.manifest import Manifest

from stores import random_kv, random_tokens, run

MODEL = "SmolLM2-135M"
HI, LO = "split16", "split16+lo"


def copies(layers=3, tokens=300, seed=0):
    g = torch.Generator().manual_seed(seed)

    def half():
        return torch.randint(-(2**15), 2**15, (2, tokens, 16), generator=g, dtype=torch.int16)

    def one():
        return [{"k": half(), "v": half()} for _ in range(layers)]

    return {HI: ({"part": "hi", "num_tokens": tokens}, one()), LO: ({"part": "lo", "hi": "abc123"}, one())}


async def collect(store, tokens, specs):
    async with contextlib.aclosing(store.stream_compressed(tokens, specs)) as it:
        return [item async for item in it]


async def manifest(store, tokens, spec):
    key = store.keys.prefix_key(tokens).copy(spec)
    return Manifest.from_bytes(await store.backend.get(key), key)


def test_copies_stream_in_order_bit_for_bit(any_url):
    tokens, comp = random_tokens(300), copies()
    kv = random_kv(3, 2, 300, 16, torch.float32)

    async def go():
        async with DualCopyStore(any_url, MODEL, torch.float32) as s:
            await s.put_prefix(tokens, kv, comp)
            got = await collect(s, tokens, [HI, LO])
            assert [(x.copy, x.index, x.count) for x in got] == [(c, i, 3) for c in (0, 1) for i in range(3)]
            for x in got:
                meta, layers = comp[(HI, LO)[x.copy]]
                assert x.meta == meta
                assert x.tensors.keys() == layers[x.index].keys()
                assert all(torch.equal(x.tensors[n], layers[x.index][n]) for n in x.tensors)
            assert [x.index for x in await collect(s, tokens, [LO])] == [0, 1, 2]  # a single copy too

    run(go())


def test_missing_copies(memory_url):
    tokens, comp = random_tokens(300), copies()

    async def go():
        async with DualCopyStore(memory_url, MODEL, torch.float32) as s:
            await s.put_prefix(tokens, random_kv(3, 2, 300, 16, torch.float32), {HI: comp[HI]})
            assert await collect(s, tokens, ["kivi:bits=4,group=32", HI]) == []  # the first one missing: a miss
            assert await collect(s, random_tokens(300, seed=5), [HI]) == []  # never stored
            assert await collect(s, tokens[:256], [HI]) == []  # exact prefix only
            with pytest.raises(MissingObject, match=r"\+lo"):  # a later one missing: before anything is yielded
                async for _ in s.stream_compressed(tokens, [HI, LO]):
                    pytest.fail("yielded a layer although a copy asked for is not stored")
            m = await manifest(s, tokens, HI)
            await s.backend.delete(m.payload_key)  # manifest left, payload evicted
            with pytest.raises(MissingObject):
                await collect(s, tokens, [HI])

    run(go())


@pytest.mark.parametrize("where", ["layer", "header", "truncated"])
def test_corruption_raises_before_the_copy_is_complete(memory_url, where, caplog):
    tokens, comp = random_tokens(300), copies()

    async def go():
        async with DualCopyStore(memory_url, MODEL, torch.float32) as s:
            await s.put_prefix(tokens, random_kv(3, 2, 300, 16, torch.float32), comp)
            m = await manifest(s, tokens, LO)
            data = bytearray(await s.backend.get(m.payload_key))
            if where == "layer":
                data[m.layers[1].offset + m.layers[1].length // 2] ^= 0x40
            elif where == "header":  # still parses, same layout: only the whole checksum can tell
                i = data.index(b"abc123")
                data[i : i + 6] = b"abc124"
            else:
                data = data[:-10]
            await s.backend.put(m.payload_key, bytes(data))
            seen = []
            error, good = {"layer": ("layer 1", 1), "header": ("checksum", 2), "truncated": ("layer 2", 2)}[where]
            with pytest.raises(CorruptObject, match=error):
                async for x in s.stream_compressed(tokens, [HI, LO]):
                    seen.append((x.copy, x.index))
            # the first copy whole; of the bad one nothing past the bad layer, and never its last layer
            assert seen == [(0, 0), (0, 1), (0, 2)] + [(1, i) for i in range(good)]

    with caplog.at_level(logging.WARNING, logger="vericache.store"):
        run(go())
    assert any("unusable" in r.getMessage() for r in caplog.records)


def test_mac_keyed_copies(memory_url):
    tokens, comp = random_tokens(300), copies()
    key = b"k" * 32

    async def go():
        async with DualCopyStore(memory_url, MODEL, torch.float32, mac_key=key) as s:
            await s.put_prefix(tokens, random_kv(3, 2, 300, 16, torch.float32), comp)
            assert len(await collect(s, tokens, [HI, LO])) == 6
        async with DualCopyStore(memory_url, MODEL, torch.float32, mac_key=b"x" * 32) as other:
            assert await collect(other, tokens, [HI, LO]) == []  # another key: a miss
        async with DualCopyStore(memory_url, MODEL, torch.float32) as keyless:
            assert await collect(keyless, tokens, [HI, LO]) == []

    run(go())


def test_copies_share_the_link_back_to_back(memory_url):
    """Over a throttled link the first copy is whole at about half the time, the second right after it."""
    tokens, comp = random_tokens(512), copies(layers=6, tokens=512)
    total = sum(t.nbytes for _, layers in comp.values() for layer in layers for t in layer.values())
    rate = 2_000_000  # ~1.6 s for both

    async def go():
        async with DualCopyStore(memory_url, MODEL, torch.float32) as s:
            await s.put_prefix(tokens, random_kv(6, 2, 512, 16, torch.float32), comp)
        async with DualCopyStore(memory_url, MODEL, torch.float32, bandwidth_bytes_per_s=rate) as slow:
            t0, stamps = time.monotonic(), {}
            async for x in slow.stream_compressed(tokens, [HI, LO]):
                stamps[(x.copy, x.index)] = time.monotonic() - t0
        return stamps

    stamps = run(go())
    expected = total / rate
    assert stamps[(1, 5)] >= 0.8 * expected, (stamps, expected)
    assert stamps[(1, 5)] < 1.5 * expected + 1.0
    assert stamps[(0, 5)] < 0.5 * stamps[(1, 5)] + 0.2  # the first copy is usable about halfway
