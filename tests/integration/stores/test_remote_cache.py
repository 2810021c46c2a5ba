"""RemotePrefixCache on a real prompt (graphlib_py, 1886 tokens -> 1792 stored, 94-token suffix): a cold
request stores both copies, a warm one drafts on the compressed copy while the full copy streams in, and
every store fault still gives the full-KV greedy output."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from types import SimpleNamespace
from urllib.parse import urlsplit

import pytest
import torch

from storage_backends import DualCopyStore, Manifest, stored_prefix_len
from storage_backends.local_connector import MemoryBackend
from vericache_connector.compressors import get_compressor
from vericache_connector.data import load_prompt
from vericache_connector.engine import VeriCacheEngine
from vericache_connector.engine.speculative import DecodeConfig
from vericache_connector.remote.prefix_cache import RemoteCacheConfig, RemotePrefixCache

from net import TcpProxy
from stores import SilentServer, closed_port, drop_memory_store, run

pytestmark = pytest.mark.slow

CFG = DecodeConfig(max_new_tokens=48, draft_k=2, adaptive=True, k_max=32, stop_at_eos=False)
FULL_SECONDS = 4.0  # read bandwidth such that the full copy takes about this long (2 s was within a loaded
# 2-core CI machine's time to fetch the compressed copy, prefill the suffix and draft: the first draft came after it)


class MemoEngine(VeriCacheEngine):
    """The session engine with prefill memoized: miss paths re-prefill the same prefix (the stream-failure
    recomputation calls the model directly, so it is never memoized)."""

    def __init__(self, engine: VeriCacheEngine):
        super().__init__(engine.model, engine.tokenizer, engine.obs_window)
        self.memo = {}

    def prefill(self, prompt_ids):
        key = tuple(prompt_ids)
        if key not in self.memo:
            self.memo[key] = super().prefill(prompt_ids)
        return self.memo[key]


@pytest.fixture(scope="module")
def env(engine):
    eng = MemoEngine(engine)
    ids = eng.encode(load_prompt("graphlib_py"))
    stored = stored_prefix_len(len(ids), 256)
    c = engine.model.cfg
    full_bytes = stored * c.num_layers * 2 * c.num_kv_heads * c.head_dim * 4
    pre = eng.prefill(ids[:stored])
    with RemotePrefixCache(eng, RemoteCacheConfig()) as cache:
        model = cache.store.keys.model_name
    return SimpleNamespace(
        engine=eng,
        ids=ids,
        stored=stored,
        full_bytes=full_bytes,
        bw=full_bytes / FULL_SECONDS,
        ref=engine.generate_full([engine.prefill(ids)], CFG)[0],
        pre=pre,
        comp=get_compressor("kivi4").compress(pre.prefix),
        model=model,
    )


def store(env, url, model=None, dtype=torch.float32) -> DualCopyStore:
    return DualCopyStore(url, model or env.model, dtype, 256)


async def seed(env, url, model=None, dtype=torch.float32):
    """Write both copies of the prefix straight through DualCopyStore (independent of the code under test)."""
    layers = [{"k": k.to(dtype), "v": v.to(dtype)} for k, v in zip(env.pre.prefix.keys, env.pre.prefix.values)]
    async with store(env, url, model, dtype) as st:
        await st.put_prefix(env.ids[: env.stored], layers, {env.comp.spec: env.comp.to_payload()})


async def present(env, url, spec=None):
    async with store(env, url) as st:
        return await st.lookup(env.ids[: env.stored]), await st.has_compressed(
            env.ids[: env.stored], spec or env.comp.spec
        )


@pytest.fixture(scope="module")
def golden(env):
    name = f"golden{uuid.uuid4().hex[:8]}"
    run(seed(env, f"local://{name}"))
    yield name
    drop_memory_store(name)


@pytest.fixture
def seeded(golden):
    """A fresh in-memory store holding both copies (a cheap copy of the golden one)."""
    name = f"rc{uuid.uuid4().hex[:10]}"
    MemoryBackend(name)._data.update(MemoryBackend(golden)._data)
    yield f"local://{name}"
    drop_memory_store(name)


def ask(env, url, decode=CFG, **kw):
    with RemotePrefixCache(env.engine, RemoteCacheConfig(url=url, **kw)) as cache:
        return cache.generate(env.ids, decode)


async def tamper(env, url, spec, chunk, fn):
    """Replace (or delete, fn -> None) the payload of one stored copy through the backend."""
    async with store(env, url) as st:
        chunks = st.keys.chunks(env.ids[: env.stored])
        key = (chunks[chunk] if spec == "full" else chunks[-1]).copy(spec)
        m = Manifest.from_bytes(await st.backend.get(key), key)
        new = fn(await st.backend.get(m.payload_key), m)
        if new is None:
            await st.backend.delete(m.payload_key)
        else:
            await st.backend.put(m.payload_key, new)


def flip_layer(layer):
    def fn(data, m):
        at = m.layers[layer].offset + m.layers[layer].length // 2
        return data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1 :]

    return fn


def warnings(caplog):
    return " | ".join(r.getMessage() for r in caplog.records if r.name == "vericache.remote" and r.levelno >= 30)


# ---- config --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw,bad",
    [
        ({"url": "ftp://x"}, "ftp://x"),
        ({"url": "nowhere"}, "nowhere"),
        ({"chunk_size": 0}, "0"),
        ({"timeout_s": -1.0}, "-1.0"),
        ({"bandwidth_bytes_per_s": 0}, "0"),
    ],
)
def test_bad_config_names_the_value(kw, bad):
    with pytest.raises(ValueError, match=bad):
        RemoteCacheConfig(**kw)


def test_bad_compressor_and_url_detail(env):
    with pytest.raises(ValueError, match="nope"):
        RemotePrefixCache(env.engine, RemoteCacheConfig(compressor="nope"))
    with pytest.raises(ValueError, match="redis://"):
        RemotePrefixCache(env.engine, RemoteCacheConfig(url="redis://"))


# ---- cold miss -> warm compressed-first hit, on every store ----------------------------------------
@pytest.mark.parametrize("backend", ["memory", "disk", "redis", "s3"])
def test_cold_then_warm(env, backend, request, caplog):
    url = request.getfixturevalue(f"{backend}_url")
    caplog.set_level(logging.INFO, logger="vericache.remote")
    with RemotePrefixCache(env.engine, RemoteCacheConfig(url=url, bandwidth_bytes_per_s=env.bw)) as cache:
        cold = cache.generate(env.ids, CFG)
        assert (cold.path, cold.wrote, cold.bytes_full) == ("miss", True, 0)
        assert cold.tokens == env.ref
        assert run(present(env, url)) == (env.stored, True)
        warm = cache.generate(env.ids, CFG)
    assert warm.path == "hit", warm.error
    assert warm.tokens == env.ref
    tm = warm.timings
    assert warm.bytes_full == env.full_bytes and 0 < warm.bytes_compressed < env.full_bytes / 3
    assert tm.full_arrived_s > 0.6 * FULL_SECONDS, "the bandwidth limit did not apply"
    # compressed first: drafting started before the full copy was in, and round 1 kept drafting until it was
    # (or until k_max); 50 ms covers sampling the last draft between its forward and the arrival check
    assert tm.first_draft_s < tm.full_arrived_s < tm.first_token_s < tm.total_s
    round1 = warm.stats.draft_lengths[0]
    assert round1 == CFG.k_max or tm.drafted_until_s > tm.full_arrived_s - 0.05, (round1, tm)
    assert "hit: 1886 prompt tokens (1792 stored)" in caplog.text


def test_short_prompt_runs_locally(env):
    ids = env.ids[:200]
    ref = env.engine.generate_full([env.engine.prefill(ids)], CFG)[0]
    with RemotePrefixCache(env.engine, RemoteCacheConfig(url="local://short")) as cache:
        res = cache.generate(ids, CFG)
    assert (res.path, res.stored_tokens, res.tokens) == ("local", 0, ref)


# ---- faults: always the full-KV output, and the path says what happened ------------------------------
@pytest.mark.parametrize("fault", ["down", "hung"])
def test_store_unreachable_recomputes(env, fault, caplog):
    silent = SilentServer() if fault == "hung" else None
    port = silent.port if silent else closed_port()
    try:
        res = ask(env, f"redis://127.0.0.1:{port}/0", timeout_s=0.5)
    finally:
        if silent:
            silent.close()
    assert (res.path, res.wrote) == ("fallback-recompute", False)
    assert res.tokens == env.ref
    assert "StoreUnavailable" in res.error and "store lookup failed" in warnings(caplog)
    assert res.timings.full_arrived_s < 3, "waited on the store past its 0.5 s timeout (prefill is memoized)"


@pytest.mark.parametrize(
    "fault,chunk,fn,why",
    [
        ("corrupt", 3, flip_layer(12), "checksum"),
        ("truncated", 5, lambda d, m: d[: len(d) // 2], "truncated"),
        ("missing", 0, lambda d, m: None, "MissingObject"),
    ],
)
def test_broken_full_copy_recomputes_prefix(env, seeded, fault, chunk, fn, why, caplog):
    run(tamper(env, seeded, "full", chunk, fn))
    res = ask(env, seeded)
    assert res.path == "hit-recompute"
    assert why in res.error and "recomputing the prefix KV locally" in warnings(caplog)
    assert res.tokens == env.ref
    assert res.bytes_compressed > 0 and res.bytes_full < env.full_bytes
    if fault == "corrupt":  # layers 0..11 arrived before the bad one
        assert res.bytes_full == 12 * env.full_bytes // 30
    assert res.wrote, "the recomputed full copy was not written back"
    again = ask(env, seeded)  # the broken chunk was repaired: a clean hit now
    assert again.path == "hit" and again.tokens == env.ref


def test_connection_dropped_mid_stream(env, redis_url, caplog):
    run(seed(env, redis_url))
    parts = urlsplit(redis_url)
    proxy = TcpProxy(parts.hostname, parts.port)
    cut_at = env.comp.nbytes + env.full_bytes // 3

    def cutter():  # drop every connection once a third of the full copy went through
        deadline = time.monotonic() + 60
        while proxy.bytes_relayed < cut_at and time.monotonic() < deadline:
            time.sleep(0.002)
        proxy.close()

    threading.Thread(target=cutter, daemon=True).start()
    try:
        res = ask(env, f"redis://127.0.0.1:{proxy.port}{parts.path}?{parts.query}", bandwidth_bytes_per_s=env.bw)
    finally:
        proxy.close()
    assert res.path == "hit-recompute", res.error
    assert "StoreUnavailable" in res.error and "recomputing" in warnings(caplog)
    assert res.tokens == env.ref
    assert 0 < res.bytes_full < env.full_bytes


@pytest.mark.parametrize("spec", ["kivi4", "snapkv-4x"])
def test_unusable_compressed_copy_uses_full(env, seeded, spec, caplog):
    """kivi4: its stored copy is corrupt; snapkv-4x: none stored (needs observation queries)."""
    full_spec = get_compressor(spec).spec
    if spec == "kivi4":
        run(tamper(env, seeded, full_spec, -1, flip_layer(7)))
    res = ask(env, seeded, compressor=spec)
    assert res.path == "full-only" and res.bytes_full == env.full_bytes and res.bytes_compressed == 0
    assert res.tokens == env.ref
    assert res.wrote, "compressed copy was not written back"
    if spec == "kivi4":
        assert "checksum" in res.error and "compressed copy unusable" in warnings(caplog)

    async def readable():
        async with store(env, seeded) as st:
            return await st.get_compressed(env.ids[: env.stored], full_spec) is not None

    assert run(readable())


def test_other_model_or_dtype_misses(env, memory_url):
    run(seed(env, memory_url, model="other-model"))
    run(seed(env, memory_url, dtype=torch.bfloat16))
    assert run(present(env, memory_url)) == (0, False)  # neither is visible to us
    res = ask(env, memory_url)
    assert (res.path, res.wrote) == ("miss", True)
    assert res.tokens == env.ref
    assert run(present(env, memory_url)) == (env.stored, True)


def test_write_failure_is_logged_and_invisible(env, private_redis, caplog):
    import redis

    admin = redis.Redis(port=private_redis.port)
    admin.config_set("maxmemory", 30 << 20)  # room for a chunk payload or two, then OOM: fails mid-write
    res = ask(env, private_redis.url)
    assert (res.path, res.wrote) == ("miss", False)
    assert res.tokens == env.ref
    assert "store write failed" in warnings(caplog) and res.error.startswith("write:")
    admin.config_set("maxmemory", 0)
    assert admin.dbsize() > 0, "nothing was written at all: the fault was not mid-write"
    assert run(present(env, private_redis.url)) == (0, False)  # no manifest: nothing half-written visible
    admin.close()


def test_sampling_on_a_hit(env, seeded):
    cfg = dataclasses.replace(CFG, temperature=0.8, seed=1234)
    res = ask(env, seeded, decode=cfg)
    assert res.path == "hit"
    assert len(res.tokens) == cfg.max_new_tokens
    assert all(0 <= t < env.engine.model.cfg.vocab_size for t in res.tokens)
    assert res.stats.accepted[0] and res.stats.mean_accepted() > 0.3
