"""The serving engine on the real model: the five bundled long prompts (1.9k-5.6k tokens) served under a
device budget that holds only some of them, full KV and VeriCache (over an emulated host link), every
request's greedy output identical to its own full-KV greedy output (the session's reference); and each
compressor the serving engine serves since issue 27 (kvpress presses with their per-head budgets topped up,
KVQuant with the RoPE frequencies, RotateKV; KVzip also with a complement reload) on the shortest prompt,
with the session's prefill, reference and press masks (tests/support/press_fixtures.py)."""

from __future__ import annotations

import press_fixtures
import pytest

from vericache_connector.compressors import get_compressor
from vericache_connector.compressors.kvpress_bridge import kvpress_available
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


NEWLY_SERVED = ["kvzip-5x", "expected-attention-4x", "adakv-ea-4x", "kvquant4", "rotatekv2"]


@pytest.mark.parametrize("spec", NEWLY_SERVED)
def test_newly_served_compressors_are_exact(engine, prefills, reference, served, tmp_path_factory, spec):
    """(issue 27, item 3) One request (graphlib_py, 1.9k tokens), 32 tokens: VeriCache's output is the full-KV
    greedy output. KVzip runs with its kept positions held exactly (draft pool float32): a complement reload."""
    store, _ = served
    p, comp = prefills[0], get_compressor(spec)
    if comp.name == "press":
        if not kvpress_available():
            pytest.skip("kvpress not installed")
        for name, masks in press_fixtures.graphlib_press_masks(prefills, tmp_path_factory).items():
            store[("press", tuple(p.prompt_ids), get_compressor(name).spec)] = masks
    extra = {"draft_dtype": "float32", "reload": "complement"} if spec == "kvzip-5x" else {}
    cfg = ServingConfig(
        policy="vericache",
        compressor=spec,
        k_max=32,
        link_bytes_per_s=2e9,
        obs_window=engine.obs_window,
        tail_full=False,  # one request alone is the trace's tail: keep it drafting on the compressor under test
        **extra,
    )
    served_engine = ServingEngine(engine.model, cfg, store)
    rep = served_engine.run([Request("r0", p.prompt_ids, 32)])
    assert rep.outputs()["r0"] == reference[0][:32], f"{spec} differs from full-KV greedy"
    assert rep.verifications >= 1 and rep.mean_accepted > 0.5
    assert served_engine.complement == (spec == "kvzip-5x")
