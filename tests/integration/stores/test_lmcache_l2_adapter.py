"""LMCache multiprocess mode: vericache_connector/integration/lmcache/l2_adapter.py as an ``lmcache server`` L2 tier.

Adapter level (tests/support/lmcache_l2.py): built from the ``--l2-adapter`` JSON by LMCache's own parser
and factory, keys from LMCache's TokenHasher / ipc_key_to_object_keys, tasks driven through the event
fds, on memory, real Redis and real S3 (moto): round trip, VeriCache readers on the same store (both
ways), cache-salt isolation, faults (store down, corrupt chunk, half-written copies, objects that do not
fit, MAC keys, LMCache's fault_inject adapter wrapped around ours), and the chain tap's absence.
Server level: ``lmcache server`` on the CPU stores a real prompt's KV (SmolLM2) through LMCache's own CPU
client; a VeriCache RemotePrefixCache then gets a compressed-first hit, output identical to full KV (Redis
and S3). The other way: a prefix a RemotePrefixCache stored is found and retrieved by a fresh server (empty
L1) from our store, KV identical to the engine's.
"""

from __future__ import annotations

import logging

import pytest
import torch
from lmcache_l2 import (
    Driver,
    LMCacheServer,
    adapter_spec,
    bench_client,
    chunk_tensors,
    make_adapter,
    memory_objects,
    object_keys,
    random_layers,
    retrieve_prompt_kv,
    store_prompt_kv,
)

from storage_backends import DualCopyStore, open_backend
from vericache_connector.compressors import LayeredKV, get_compressor
from vericache_connector.integration.lmcache.chain_tap import TAP

from net import free_port, wait_until
from stores import has_module, need, random_tokens, run

MODEL, MODEL_ID = "org/smol", "smol.0123"
SPEC = get_compressor("kivi4").spec


@pytest.fixture(autouse=True)
def _lmcache():
    need(has_module("lmcache"), "lmcache is not installed (pip install --no-deps lmcache==0.5.6)")
    TAP.clear()


@pytest.fixture
def adapters():
    made = []

    def make(url, spec=None, **params):
        a = make_adapter({"url": url, "kv_dtype": "float32", "head_dim": 64, "model_id": MODEL_ID, **params}, spec)
        made.append(a)
        return a, Driver(a)

    yield make
    for a in made:
        a.close()


def reader(url, salt="", model_name=MODEL_ID, **kw) -> DualCopyStore:
    return DualCopyStore(url, model_name, torch.float32, key_hashing="lmcache", cache_salt=salt, **kw)


def ask(url, fn, salt="", **kw):
    """fn(store) with a fresh VeriCache reader (key_hashing="lmcache"), in one event loop."""

    async def go():
        async with reader(url, salt, **kw) as store:
            return await fn(store)

    return run(go())


def zeros_like(objs):
    return memory_objects([torch.zeros_like(o.tensor) for o in objs])


def prompt(n=800, seed=0):
    return random_tokens(n, seed=seed), random_layers(n, seed=seed)


@pytest.mark.parametrize("kind", ["memory", "redis", "s3"])
def test_round_trip_and_vericache_reads_it_compressed_first(kind, request, adapters):
    url = request.getfixturevalue(f"{kind}_url")
    adapter, d = adapters(url)
    tokens, layers = prompt()
    keys, objs = object_keys(tokens, MODEL), memory_objects(chunk_tensors(layers))
    result = d.store(keys, objs)
    assert result.is_successful() and result.bytes_transferred() > 0
    assert d.lookup(keys) == [True] * 3
    assert d.lookup(object_keys(random_tokens(512, seed=9), MODEL, tap=False)) == [False, False]
    bufs = zeros_like(objs)
    assert d.load(keys, bufs) == [True] * 3
    assert all(torch.equal(a.tensor, b.tensor) for a, b in zip(objs, bufs))
    usage = adapter.get_usage()
    assert usage.total_bytes_used == sum(o.get_size() for o in objs) and dict(usage.bytes_by_cache_salt) == {
        "": usage.total_bytes_used
    }
    # VeriCache's reader, same store: the full copy checks out chunk by chunk, the compressed copy follows
    assert ask(url, lambda s: s.lookup(tokens[:768])) == 768
    full = ask(url, lambda s: s.get_full(tokens[:768]))
    assert all(torch.equal(k, lk[:, :768]) and torch.equal(v, lv[:, :768]) for (k, v), (lk, lv) in zip(full, layers))
    assert wait_until(lambda: ask(url, lambda s: s.has_compressed(tokens[:768], SPEC)), 30, 0.1)
    comp = LayeredKV.from_payload(*ask(url, lambda s: s.get_compressed(tokens[:768], SPEC)))
    get_compressor(SPEC).validate(comp, 768, 2, 3, 64)
    assert d.store(keys, objs).bytes_transferred() == 0  # stored already: skipped


def test_prefix_vericache_wrote_is_an_lmcache_hit(memory_url, adapters):
    tokens, layers = prompt(seed=1)
    ask(memory_url, lambda s: s.put_prefix(tokens[:512], [{"k": k[:, :512], "v": v[:, :512]} for k, v in layers]))
    _, d = adapters(memory_url)
    keys = object_keys(tokens, MODEL, tap=False)  # LMCache's keys of the same tokens
    assert d.lookup(keys) == [True, True, False]
    want = memory_objects(chunk_tensors(layers))
    bufs = zeros_like(want)
    assert d.load(keys, bufs) == [True, True, False]
    assert torch.equal(bufs[0].tensor, want[0].tensor) and torch.equal(bufs[1].tensor, want[1].tensor)
    assert not bufs[2].tensor.any()


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_cache_salt_isolation(kind, request, adapters):
    url = request.getfixturevalue(f"{kind}_url")
    adapter, d = adapters(url)
    tokens, layers = prompt(seed=2)
    _, other_layers = prompt(seed=3)
    a_objs, plain_objs = memory_objects(chunk_tensors(layers)), memory_objects(chunk_tensors(other_layers))
    assert d.store(object_keys(tokens, MODEL, salt="tenant-a"), a_objs).is_successful()
    for salt in ("tenant-b", ""):  # same tokens, same model, another salt (or none): nothing is found
        keys = object_keys(tokens, MODEL, salt=salt, tap=False)
        assert d.lookup(keys) == [False] * 3
        bufs = zeros_like(a_objs)
        assert d.load(keys, bufs) == [False] * 3 and not any(b.tensor.any() for b in bufs)
    for salt, want in (("", 0), ("tenant-b", 0), ("tenant-a", 768)):  # VeriCache readers: the same isolation
        assert ask(url, lambda s: s.lookup(tokens[:768]), salt) == want
    # the same prefix stored unsalted with other KV: each salt gets its own
    assert d.store(object_keys(tokens, MODEL), plain_objs).is_successful()
    for salt, want in (("tenant-a", a_objs), ("", plain_objs)):
        bufs = zeros_like(want)
        assert d.load(object_keys(tokens, MODEL, salt=salt, tap=False), bufs) == [True] * 3
        assert all(torch.equal(b.tensor, w.tensor) for b, w in zip(bufs, want))
    assert set(adapter.get_usage().bytes_by_cache_salt) == {"tenant-a", ""}


def test_store_down_is_a_failure_and_a_miss(private_redis, adapters, caplog):
    adapter, d = adapters(private_redis.url, timeout_s=1.0)
    tokens, layers = prompt(seed=4)
    keys, objs = object_keys(tokens, MODEL), memory_objects(chunk_tensors(layers))
    assert d.store(keys, objs).is_successful()
    private_redis.kill()
    with caplog.at_level(logging.WARNING, logger="vericache.store"):
        assert not d.store(object_keys(random_tokens(512, seed=5), MODEL), objs[:2]).is_successful()
        assert d.lookup(keys) == [False] * 3
        bufs = zeros_like(objs)
        assert d.load(keys, bufs) == [False] * 3 and not any(b.tensor.any() for b in bufs)
    assert adapter.report_status()["faults"] >= 3 and "failed" in caplog.text


def manifest_and_payload(url, key_string):
    from storage_backends import Manifest

    backend = open_backend(url)
    raw = run(backend.get(key_string))
    return backend, Manifest.from_bytes(raw, key_string)


def test_corrupt_chunk_and_half_written_copies_are_misses(memory_url, adapters):
    _, d = adapters(memory_url)
    tokens, layers = prompt(seed=6)
    keys, objs = object_keys(tokens, MODEL), memory_objects(chunk_tensors(layers))
    assert d.store(keys, objs).is_successful()
    chunks = reader(memory_url).keys.chunks(tokens[:768])
    backend, m1 = manifest_and_payload(memory_url, chunks[1].copy("full"))
    data = bytearray(run(backend.get(m1.payload_key)))
    data[len(data) // 2] ^= 0xFF  # one flipped byte in chunk 1
    run(backend.put(m1.payload_key, bytes(data)))
    bufs = zeros_like(objs)
    assert d.load(keys, bufs) == [True, False, True] and not bufs[1].tensor.any()
    _, m2 = manifest_and_payload(memory_url, chunks[2].copy("full"))
    run(backend.delete(m2.payload_key))  # manifest without its payload
    run(backend.delete(chunks[0].copy("full")))  # payload without its manifest
    assert d.lookup(keys)[0] is False
    assert d.load(keys, zeros_like(objs)) == [False, False, False]


def test_objects_and_keys_that_do_not_fit_are_skipped(memory_url, adapters, caplog):
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey

    adapter, d = adapters(memory_url)
    tokens, layers = prompt(seed=7)
    keys, objs = object_keys(tokens, MODEL), memory_objects(chunk_tensors(layers))
    half = memory_objects([objs[1].tensor.half()])[0]
    group1 = ObjectKey(keys[2].chunk_hash, MODEL, keys[2].kv_rank, object_group_id=1)
    with caplog.at_level(logging.WARNING, logger="vericache.store"):
        result = d.store([keys[0], keys[1], group1], [objs[0], half, objs[2]])
    assert not result.is_successful() and "not stored" in caplog.text  # coarse: the task failed, chunk 0 stored
    assert d.lookup(keys) == [True, False, False] and d.lookup([group1]) == [False]
    layout = {0: MemoryLayoutDesc([torch.Size([2, 2, 256, 192])], [torch.float16])}
    assert d.lookup(keys[:1], layout) == [False]  # LMCache asks for another dtype
    wrong = memory_objects([torch.zeros(2, 3, 256, 192)])  # a buffer of another model (3 layers)
    assert d.load(keys[:1], wrong) == [False] and not wrong[0].tensor.any()


def test_mac_key_both_ways(memory_url, adapters, tmp_path):
    (tmp_path / "key").write_bytes(b"l2-adapter-mac-key-0123456789abcdef")
    _, keyed = adapters(memory_url, mac_key_file=str(tmp_path / "key"))
    _, plain = adapters(memory_url)
    tokens, layers = prompt(seed=8)
    keys, objs = object_keys(tokens, MODEL), memory_objects(chunk_tensors(layers))
    assert plain.store(keys[:1], objs[:1]).is_successful()  # written without the key
    assert keyed.lookup(keys[:1]) == [False] and keyed.load(keys[:1], zeros_like(objs[:1])) == [False]
    assert keyed.store(keys[1:], objs[1:]).is_successful()
    bufs = zeros_like(objs[1:])
    assert keyed.load(keys[1:], bufs) == [True, True] and torch.equal(bufs[0].tensor, objs[1].tensor)
    assert plain.load(keys[1:], zeros_like(objs[1:])) == [False, False]  # keyed entries, reader without the key
    key = (tmp_path / "key").read_bytes()
    assert ask(memory_url, lambda s: s.lookup(tokens[:768]), mac_key=key) == 0  # chunk 0 is unkeyed: stops there


def test_lmcache_fault_inject_adapter_wraps_ours(memory_url, adapters):
    import json

    params = {"url": memory_url, "kv_dtype": "float32", "head_dim": 64, "model_id": MODEL_ID}
    inner = json.loads(adapter_spec(params))
    adapter, d = adapters(memory_url, spec=json.dumps({"type": "fault_inject", "inner": inner, "gap_indices": [1]}))
    assert type(adapter).__name__ == "FaultInjectL2Adapter"
    tokens, layers = prompt(seed=10)
    keys, objs = object_keys(tokens, MODEL), memory_objects(chunk_tensors(layers))
    assert d.store(keys, objs).is_successful()
    assert d.lookup(keys) == [True] * 3
    bufs = zeros_like(objs)
    assert d.load(keys, bufs) == [True, False, True]  # the injected L2 retrieve error is a miss
    assert torch.equal(bufs[2].tensor, objs[2].tensor)


def test_without_the_chain_tap_vericache_readers_see_nothing_wrong(memory_url, adapters):
    _, d = adapters(memory_url)
    tokens, layers = prompt(seed=11)
    keys, objs = object_keys(tokens, MODEL, tap=False), memory_objects(chunk_tensors(layers))
    assert d.store(keys, objs).is_successful()
    bufs = zeros_like(objs)
    assert d.load(keys, bufs) == [True] * 3 and torch.equal(bufs[1].tensor, objs[1].tensor)  # LMCache: served
    assert ask(memory_url, lambda s: s.lookup(tokens[:768])) == 0  # no full copy with a range it could not know
    assert d.store(object_keys(tokens, MODEL), objs).is_successful()  # the tap learned the chain: full copies
    assert ask(memory_url, lambda s: s.lookup(tokens[:768])) == 768
    assert wait_until(lambda: ask(memory_url, lambda s: s.has_compressed(tokens[:768], SPEC)), 30, 0.1)


# ---------------------------------------------------------------- lmcache server on the CPU
@pytest.mark.parametrize("kind", ["redis", "s3"])
def test_lmcache_server_stores_vericache_reads_compressed_first(kind, request, engine, model_dir, tmp_path):
    from vericache_connector.data import load_prompt
    from vericache_connector.engine.speculative import DecodeConfig
    from vericache_connector.remote.prefix_cache import RemoteCacheConfig, RemotePrefixCache

    url = request.getfixturevalue(f"{kind}_url")
    ids = engine.encode(load_prompt("graphlib_py"))[:1500]
    stored = 1280  # LMCache stores whole chunks: 5 x 256; VeriCache's stored_prefix_len(1500) is the same
    c = engine.model.cfg
    params = {
        "url": url,
        "kv_dtype": "float32",
        "model_dir": model_dir,
        "served_model": "test-model",
        "compressor": "kivi4",
    }
    server = LMCacheServer(adapter_spec(params), str(tmp_path / "server.log"), free_port(), free_port())
    try:
        server.wait_ready()
        client = bench_client(server, c.num_layers, c.num_kv_heads, c.head_dim, num_blocks=stored // 16)
        pre = engine.prefill(ids[:stored])
        try:
            assert store_prompt_kv(client, ids, list(zip(pre.prefix.keys, pre.prefix.values)))
        finally:
            client.close()
        kw = {"model_name": engine.model_name}
        compressed = lambda: ask(url, lambda s: s.has_compressed(ids[:stored], SPEC), **kw)  # noqa: E731
        assert wait_until(compressed, 120, 0.5), server.log()[-3000:]
    finally:
        server.stop()
    full = ask(url, lambda s: s.get_full(ids[:stored]), **kw)  # the engine's KV, as LMCache's server stored it
    assert all(
        torch.equal(k, pk) and torch.equal(v, pv) for (k, v), pk, pv in zip(full, pre.prefix.keys, pre.prefix.values)
    )
    cfg = DecodeConfig(max_new_tokens=8, draft_k=4, stop_at_eos=False)
    reference = engine.generate_full([engine.prefill(ids)], cfg)[0]
    with RemotePrefixCache(engine, RemoteCacheConfig(url=url, compressor="kivi4", key_hashing="lmcache")) as cache:
        res = cache.generate(ids, cfg)
    assert res.path == "hit" and res.bytes_compressed > 0 and res.stored_tokens == stored
    assert res.tokens == reference


def test_prefix_vericache_stored_is_served_by_a_fresh_lmcache_server(redis_url, engine, model_dir, tmp_path):
    from vericache_connector.data import load_prompt
    from vericache_connector.engine.speculative import DecodeConfig
    from vericache_connector.remote.prefix_cache import RemoteCacheConfig, RemotePrefixCache

    ids = engine.encode(load_prompt("graphlib_py"))[:1100]  # 1024 stored: 4 chunks
    cfg = DecodeConfig(max_new_tokens=4, draft_k=4, stop_at_eos=False)
    with RemotePrefixCache(
        engine, RemoteCacheConfig(url=redis_url, compressor="kivi4", key_hashing="lmcache")
    ) as cache:
        res = cache.generate(ids, cfg)
    assert res.path == "miss" and res.wrote and res.stored_tokens == 1024
    c = engine.model.cfg
    params = {"url": redis_url, "kv_dtype": "float32", "model_dir": model_dir, "served_model": "test-model"}
    server = LMCacheServer(adapter_spec(params), str(tmp_path / "server.log"), free_port(), free_port())
    try:
        server.wait_ready()  # a fresh server: its L1 is empty, every hit comes from our store
        client = bench_client(server, c.num_layers, c.num_kv_heads, c.head_dim, num_blocks=1024 // 16)
        try:
            hits, kv = retrieve_prompt_kv(client, ids)
        finally:
            client.close()
    finally:
        server.stop()
    assert hits == 4 and kv is not None, server.log()[-3000:]
    pre = engine.prefill(ids[:1024])
    assert all(
        torch.equal(k, pk) and torch.equal(v, pv) for (k, v), pk, pv in zip(kv, pre.prefix.keys, pre.prefix.values)
    )
