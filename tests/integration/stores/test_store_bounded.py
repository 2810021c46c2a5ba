"""A bounded store stays consistent (issue 40, item 2), through RemotePrefixCache on a tiny model whose every
output is checked against its own plain full-KV greedy decoding:

- a workload writing 4x a Redis `maxmemory` under `allkeys-lru` (Redis evicts single keys: lone copies,
  manifests without payloads): no failed request, every output exact, the hit rate reported; the same on a
  disk store under `max_bytes`, which stays under it;
- each lone copy as docs/operations.md says: a lone full copy is loaded and the compressed copy written
  back (full-only), a lone compressed copy is a miss that rewrites both, a manifest whose payload went is
  recomputed (hit-recompute, full) or a miss of that copy (full-only, compressed);
- a TTL on Redis and S3: both copies expire, and a hit refreshes both."""

from __future__ import annotations

import os
import random
import time

import pytest

from storage_backends import DualCopyStore, Manifest

from store_workload import RedisNode, Workload
from stores import run

CAPACITY = 1 << 20  # bytes of entries the bounded stores hold


@pytest.fixture(scope="module")
def wl():
    return Workload(prompts=26, tokens=(150, 260)).warm()


def stored_bytes(wl, i: int) -> int:
    """What prompt i's two copies take (tiny model: 1 KiB of full KV per token, kivi4 about a sixth)."""
    n = (len(wl.ids[i]) - 1) // 32 * 32
    return n * 1024 * 7 // 6


def mixed_requests(wl, n: int, hot: int = 3, seed: int = 0) -> list[int]:
    """Every other prompt once, asked again right away (a second turn), between them a few hot prompts."""
    rnd, out = random.Random(seed), []
    for i in range(hot, len(wl.ids)):
        out += [i, i, rnd.randrange(hot)]
    return out[:n]


def run_workload(wl, url: str, check=None) -> None:
    wl.paths.clear(), wl.wrong.clear()
    order = mixed_requests(wl, 60)
    assert sum(stored_bytes(wl, i) for i in set(order)) >= 4 * CAPACITY, "the workload does not fill the store 4x"
    with wl.cache(url) as cache:
        for i in order:
            wl.ask(cache, i)  # raises on a failed request
            if check is not None:
                check()
    print(f"{url.split('?')[0]}: hit rate {wl.hit_rate:.2f}, paths {dict(wl.paths)}")
    assert not wl.wrong, wl.wrong
    # Redis' LRU clock ticks once a second: within this workload's few seconds its eviction is close to random,
    # so the hit rate here is far below a real workload's; what matters is that hits happen and are exact
    assert wl.paths["hit"] > 0, dict(wl.paths)


def test_a_workload_of_4x_redis_maxmemory_under_allkeys_lru(wl, tmp_path, record_property):
    node = RedisNode(tmp_path, "--maxmemory-policy", "allkeys-lru")
    try:
        admin = node.client()
        base = admin.info("memory")["used_memory"]
        admin.config_set("maxmemory", base + CAPACITY)
        run_workload(wl, f"redis://127.0.0.1:{node.port}/0")
        record_property("hit_rate", round(wl.hit_rate, 3))
        assert admin.info("stats")["evicted_keys"] > 0
        admin.close()
    finally:
        node.kill()


def test_a_workload_of_4x_a_disk_stores_max_bytes(wl, tmp_path):
    root = tmp_path / "store"

    def under():
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)
        assert size <= CAPACITY, f"{size} bytes on disk, max_bytes {CAPACITY}"

    run_workload(wl, f"local://{root}?max_bytes={CAPACITY}", under)


# ---- lone copies ----------------------------------------------------------------------------------------
async def drop(wl, url: str, i: int, copy: str, what: str) -> None:
    """Delete one stored object of prompt i, as a per-key eviction would: the manifest of `copy`
    (the whole copy of that chunk becomes invisible) or its payload (the manifest stays)."""
    ids = wl.ids[i][: (len(wl.ids[i]) - 1) // 32 * 32]
    async with DualCopyStore(url, wl.engine.model_name, wl.engine.model.dtype, 32) as st:
        chunks = st.keys.chunks(ids)
        key = (chunks[1] if copy == "full" else chunks[-1]).copy(copy)
        m = Manifest.from_bytes(await st.backend.get(key), key)
        for k in (key, m.payload_key) if what == "manifest" else (m.payload_key,):
            await st.backend.delete(k)


async def present(wl, url: str, i: int, spec: str):
    ids = wl.ids[i][: (len(wl.ids[i]) - 1) // 32 * 32]
    async with DualCopyStore(url, wl.engine.model_name, wl.engine.model.dtype, 32) as st:
        return await st.lookup(ids) == len(ids), await st.has_compressed(ids, spec)


@pytest.mark.parametrize(
    "copy,what,path",
    [
        ("full", "manifest", "miss"),  # a lone compressed copy: recomputed, both copies written
        ("compressed", "manifest", "full-only"),  # a lone full copy: loaded, the compressed copy written back
        ("full", "payload", "hit-recompute"),  # a full-copy manifest whose payload went: recomputed, repaired
        ("compressed", "payload", "full-only"),  # a compressed manifest whose payload went: the full copy
    ],
)
def test_a_lone_copy_is_served_exactly_and_made_whole(wl, memory_url, copy, what, path):
    with wl.cache(memory_url) as cache:
        assert wl.ask(cache, 0).path == "miss"
        spec = cache.compressor.spec
        run(drop(wl, memory_url, 0, spec if copy == "compressed" else "full", what))
        res = wl.ask(cache, 0)
        assert res.path == path and res.tokens == wl.ref(0), (res.path, res.error)
        assert run(present(wl, memory_url, 0, spec)) == (True, True)  # both copies whole again
        assert wl.ask(cache, 0).path == "hit"


# ---- TTL --------------------------------------------------------------------------------------------------
def redis_ttls(url: str) -> list[int]:
    """PTTL of every key under the URL's prefix (ms; -1: none)."""
    import redis

    base, _, query = url.partition("?")
    prefix = dict(p.split("=", 1) for p in query.split("&"))["prefix"]
    r = redis.Redis.from_url(base)
    try:
        return [r.pttl(k) for k in r.scan_iter(match=prefix + "*")]
    finally:
        r.close()


def test_redis_ttl_expires_both_copies_and_a_hit_refreshes_them(wl, redis_url):
    url = f"{redis_url}&ttl_s=3"
    wl.ref(1)  # computed before the clock matters
    with wl.cache(url) as cache:
        assert wl.ask(cache, 1).path == "miss"
        ttls = redis_ttls(redis_url)
        assert len(ttls) >= 8 and all(0 < t <= 3000 for t in ttls), ttls  # both copies, every chunk
        time.sleep(1.5)  # every key has 1.5 s left at most
        assert wl.ask(cache, 1).path == "hit"
        ttls = redis_ttls(redis_url)
        assert all(1600 < t <= 3000 for t in ttls), ttls  # refreshed: the compressed copy's keys too
        time.sleep(3.1)
        assert redis_ttls(redis_url) == []  # both copies expired
        res = wl.ask(cache, 1)
        assert res.path == "miss" and res.tokens == wl.ref(1)


def test_s3_ttl_expires_both_copies_and_a_hit_refreshes_them(wl, s3_url):
    """S3 deletes nothing: an object older than ttl_s (its LastModified, whole seconds) reads as absent,
    and a hit copies each object of both copies onto itself (a new LastModified)."""
    import boto3

    q = dict(p.split("=", 1) for p in s3_url.split("?", 1)[1].split("&"))
    bucket, prefix = s3_url[5:].split("?")[0].split("/", 1)
    s3 = boto3.client("s3", endpoint_url=q["endpoint_url"], region_name="us-east-1")

    def modified():
        objs = s3.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", [])
        return {o["Key"]: o["LastModified"].timestamp() for o in objs}

    def wait_until(t: float) -> None:
        time.sleep(max(0.0, t - time.time()))

    # a GET's Last-Modified has whole seconds: an object written at w reads as expired after floor(w) + ttl_s
    wl.ref(2)  # computed before the clock matters
    with wl.cache(f"{s3_url}&ttl_s=3") as cache:
        assert wl.ask(cache, 2).path == "miss"
        t_written, written = time.time(), modified()
        assert len(written) >= 8
        # a refresh then gets a later whole second, and is due (ttl_s / 4 after the write); >= 1.2 s before expiry
        wait_until(max(max(written.values()) + 1.05, t_written + 0.8))
        assert wl.ask(cache, 2).path == "hit"
        refreshed = modified()
        assert refreshed.keys() == written.keys()
        assert all(refreshed[k] > written[k] for k in written), "a hit did not refresh every object of both copies"
        wait_until(max(refreshed.values()) + 3.05)
        assert run(present(wl, f"{s3_url}&ttl_s=3", 2, cache.compressor.spec)) == (False, False)
        res = wl.ask(cache, 2)
        assert res.path == "miss" and res.tokens == wl.ref(2)
