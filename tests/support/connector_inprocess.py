"""The vLLM connector in-process (test_connector_scheduler_inprocess.py, test_connector_worker_inprocess.py,
test_draft_role_inprocess.py): the bundled model's shape and a prompt with a stored prefix, the store seeded with
it, a worker-side connector over a paged KV buffer in vLLM's CPU layout, and the waits on what runs on the store
loop. Imported after pytest.importorskip("vllm")."""

from __future__ import annotations

import time

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from storage_backends import DualCopyStore
from vericache_connector.integration.vllm.connector.config import PROPOSER_CLASS
from vericache_connector.integration.vllm.connector.paged_layout import kv_views
from vericache_connector.integration.vllm.connector.stats import VeriCacheStats

from net import wait_for  # noqa: F401 - the in-process tests' wait, from here with the rest of their set-up
from stores import random_kv
from vllm_unit import BLOCK_SIZE, create_vllm_config

PROMPT = list(range(1000, 1600))  # 600 tokens: 2 whole chunks of 256 stored (512), 88 computed
STORED = 512
LAYERS, HEADS, DIM = 30, 3, 64
NUM_BLOCKS = 10  # a worker's paged buffer


def store_model() -> str:
    """How the connector names the converted bundled model in store keys (model_name_of: name.fingerprint)."""
    from vericache_connector.model.loader import model_identity, resolve_model_dir

    return model_identity(resolve_model_dir(None), torch.float32)


def vllm_config(model_dir, url, **extra):
    return create_vllm_config(model_dir, {"store": url, "compressor": "int8", **extra}, **extra.pop("_cfg", {}))


async def seed_prefix(url: str, prompt: list[int]) -> None:
    """The full copy of `prompt` (random KV) in the store at url."""
    async with DualCopyStore(url, store_model(), torch.float32, 256) as st:
        layers = random_kv(LAYERS, HEADS, len(prompt), DIM, torch.float32)
        await st.put_prefix(prompt, layers)


def worker(model_dir, url, proposer: bool = False, compressor: str = "int8", dtype=torch.float32):
    """A worker-side connector (with our proposer's handoff: proposer=True) over NUM_BLOCKS blocks: (conn, views)."""
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


def drained(get, until, timeout_s: float = 10.0) -> VeriCacheStats:
    """The connector's stats as vLLM drains them (get: one drain), summed until `until` holds."""
    got, deadline = VeriCacheStats(), time.monotonic() + timeout_s
    while not until(got):
        assert time.monotonic() < deadline, got.reduce()
        got.aggregate(get() or VeriCacheStats())
        time.sleep(0.02)
    return got
