"""The serving engine on the real model: the five bundled long prompts (1.9k-5.6k tokens) served under a
device budget that holds only some of them, full KV and VeriCache (over an emulated host link), every
request's greedy output identical to its own full-KV greedy output (the session's reference)."""

from __future__ import annotations

import pytest

from vericache_connector.engine.config import ServingConfig
from vericache_connector.engine.sequence import Request
from vericache_connector.engine.serving import ServingEngine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(engine, prefills):
    """The session's prefills seed the serving engines' prefill store (no prompt is computed twice)."""
    store = {}
    for p in prefills:
        layers = list(zip(p.prefix.keys, p.prefix.values, p.prefix.obs_queries))
        store[(tuple(p.prompt_ids), 0)] = (p.logits, [(k, v, None) for k, v, _ in layers])
        store[(tuple(p.prompt_ids), engine.obs_window)] = (p.logits, layers)
    mc = engine.model.cfg
    per_token = mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * 4
    demand = sum((p.num_tokens + 64) * per_token for p in prefills)
    return store, demand


@pytest.mark.parametrize("policy,budget,link", [("full", 0.45, None), ("vericache", 0.25, 2e9)])
def test_served_outputs_equal_full_kv_greedy(engine, prefills, reference, served, policy, budget, link):
    store, demand = served
    trace = [Request(f"r{i}", p.prompt_ids, 64, arrival_s=0.5 * i) for i, p in enumerate(prefills)]
    cfg = ServingConfig(
        policy=policy,
        budget_bytes=int(budget * demand),
        compressor="snapkv-4x",
        k_max=32,
        link_bytes_per_s=link,
        obs_window=engine.obs_window,
    )
    rep = ServingEngine(engine.model, cfg, store).run(trace)
    outs = rep.outputs()
    for i, ref in enumerate(reference):
        assert outs[f"r{i}"] == ref, f"{policy}: request {i} differs from its full-KV greedy output"
    assert rep.peak_resident_bytes <= rep.budget_bytes and rep.reload_failures == 0
    if policy == "vericache":
        assert rep.mean_accepted > 1.0 and rep.link_max_concurrent == 1
