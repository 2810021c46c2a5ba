"""The capacity model (vericache_connector/engine/capacity.py) against hand-computed cases; the serving engine
falling back to full KV where it predicts that offloading loses (and only there), its output exact either way;
cost_model.py --serving printing the paper's table next to the model's prediction, within the issue's bounds."""

from __future__ import annotations

import json

import pytest
import torch

from vericache_connector.engine import DecodeConfig
from vericache_connector.engine import capacity as C
from vericache_connector.engine.config import ServingConfig
from vericache_connector.engine.sequence import Request
from vericache_connector.engine.serving import ServingEngine

from tiny_model import tiny_engine

# 1e12 B/s memory, no compute limit; 2e9 weight bytes; 2000 B of KV per token, 500k tokens: 1e9 B per request
HW = C.Hardware("toy", 1e12, 1e18, 1e12, 1e15)
WL = C.Workload(2e9, 1e9, 2000, 4, 500_000, 4.5e9)


def test_prediction_by_hand():
    p = C.predict(HW, WL, compression=0.25, alpha=0.0)
    assert p.full_rows == 4 and p.full_step_s == pytest.approx(6e-3)  # (2e9 + 4e9) / 1e12
    assert p.vc_rows == 16 and p.vc_horizon == 1  # (4.5e9 - 0.5e9 staging) / 0.25e9; nothing accepted
    slow = C.predict(C.Hardware("toy", 1e12, 1e18, 1e12, 1e9), WL, 0.25, alpha=0.9)
    assert slow.link_bound and slow.vc_tokens_per_s == pytest.approx(C.expected_tokens(0.9, slow.vc_horizon))
    # a complement reload moves 3/4 of the prompt: the link allows 4/3 as many verifications
    part = C.predict(C.Hardware("toy", 1e12, 1e18, 1e12, 1e9), WL, 0.25, alpha=0.9, reload_fraction=0.75)
    assert part.vc_tokens_per_s == pytest.approx(slow.vc_tokens_per_s / 0.75, rel=0.05)
    assert C.fit_alpha(8, sum(0.9**i for i in range(1, 9))) == pytest.approx(0.9)
    with pytest.raises(ValueError, match="0 < compression <= 1"):
        C.predict(HW, WL, 0.0, 0.5)


def test_attention_arithmetic_counts_where_the_hardware_says_it_costs():
    """Attention rates (a CPU's): a verification's x + 1 queries over the prompt and the drafts' queries over the
    compressed KV add compute time; a token dropper's drafts attend its kept share only. Defaults (None): the
    GEMM's rate, which leaves a GPU's memory-bound prediction as it was."""
    pair = 4 * 8 * 128 * 4  # 4 Hq D L
    wl = C.Workload(2e9, 1e9, 2000, 4, 500_000, 4.5e9, attn_flops_per_pair=pair)
    assert C.predict(HW, wl, 0.25, 0.9).speedup == pytest.approx(C.predict(HW, WL, 0.25, 0.9).speedup)
    cpu = C.Hardware("cpu", 1e12, 1e18, 1e12, 1e15, attn_flops=1e12, draft_attn_flops=1e11)
    p = C.predict(cpu, wl, 0.25, alpha=0.0)  # x = 1: 16 rows, 16 verifying with 2 queries each
    # the linear layers read the weights (2 ms), then attention: 4 rows' KV (4 ms) or 4 queries' arithmetic
    assert p.full_step_s == pytest.approx(2e-3 + max(4e-3, pair * 4 * 500_000 / 1e12))
    dense, draft = 16 * 2 * 500_000 * pair / 1e12, 16 * 500_000 * pair / 1e11  # both far above 20 ms of KV reads
    assert p.vc_step_s == pytest.approx(2e-3 + dense + draft)
    dropped = C.predict(cpu, wl, 0.25, alpha=0.0, draft_keys=0.25)
    assert dropped.vc_step_s == pytest.approx(2e-3 + dense + draft / 4)
    with pytest.raises(ValueError, match="draft_keys"):
        C.predict(cpu, wl, 0.25, 0.5, draft_keys=0.0)


def test_acceptance_of_a_trace_by_hand():
    """The per-draft acceptance a report gives: accepted drafts over accepted + rounds cut short."""
    from vericache_connector.engine.report import RequestRecord, acceptance

    rec = lambda acc, drafted: RequestRecord("r", 1, 1, 0.0, 0.0, 0.0, 1.0, acc, [], 0, drafted)  # noqa: E731
    assert acceptance([rec([3, 8], [8, 8]), rec([0], [4])]) == pytest.approx(11 / 13)
    assert acceptance([rec([], [])]) is None


@pytest.mark.parametrize("compressor", ["kivi4", "snapkv-4x"])
def test_attention_rates_time_the_kernels_the_engine_runs(tiny, compressor):
    """engine/calibrate.py: FLOP/s equivalents of a verification's dense attention and of a draft step's
    attention over the compressed prompt as the pools hold it (packed KIVI codes; kept float16 entries)."""
    from vericache_connector.engine.calibrate import attention_rates

    eng = ServingEngine(tiny[0].model, ServingConfig(compressor=compressor))
    assert (eng.packed is not None) == (compressor == "kivi4")
    dense, draft = attention_rates(eng, context=600, verify_queries=4, rows=2, repeat=1)
    assert 1e6 < dense < 1e15 and 1e6 < draft < 1e15
    with pytest.raises(ValueError, match="context"):
        attention_rates(eng, context=0)


@pytest.fixture(scope="module")
def tiny():
    eng = tiny_engine(num_layers=4)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (400, 520, 610)]
    refs = [eng.generate_full([eng.prefill(p)], DecodeConfig(max_new_tokens=12, stop_at_eos=False))[0] for p in prompts]
    return eng, prompts, refs


@pytest.mark.parametrize("link,served", [(1e3, "full"), (1e13, "vericache")])
def test_the_engine_serves_full_kv_where_the_model_predicts_a_loss(tiny, link, served):
    """A link too slow for any reload to pay: the engine predicts VeriCache < full KV and serves full KV; a fast
    one: it serves VeriCache. Outputs are the full-KV greedy outputs in both."""
    eng, prompts, refs = tiny
    mc = eng.model.cfg
    budget = int(1.9 * (610 + 12) * mc.kv_bytes_per_token(4))  # one full-KV row at a time, three VeriCache rows
    hw = C.Hardware("cpu (test figures)", 2e10, 1e11, 1e9, link)
    cfg = ServingConfig(policy="vericache", budget_bytes=budget, compressor="kivi2", k_max=8, hardware=hw)
    rep = ServingEngine(eng.model, cfg).run([Request(f"r{i}", p, 12) for i, p in enumerate(prompts)])
    assert [rep.outputs()[f"r{i}"] for i in range(3)] == refs
    assert rep.policy == "vericache" and rep.served_policy == served
    assert (rep.prediction["speedup"] > 1) == (served == "vericache")
    assert (rep.verifications > 0) == (served == "vericache")
    assert (rep.alpha is not None) == (served == "vericache") and (rep.alpha is None or 0 <= rep.alpha <= 1)
    assert sum(len(r.drafted) for r in rep.requests) == rep.verifications
    with pytest.raises(ValueError, match="hardware must be an engine.capacity.Hardware"):
        ServingConfig(hardware="H200")


def test_cost_model_prints_the_papers_table_within_the_bounds(tmp_path, capsys):
    from benchmarks import cost_model

    out = tmp_path / "cm"
    assert cost_model.main(["--serving", "--out", str(out), "--serving-context", "32768"]) == 0
    text = capsys.readouterr().out
    assert "| 0.74 | 102 |" in text and "| 0.2 | 102 |" in text
    doc = json.loads(next(out.glob("*/results.json")).read_text())
    for row in doc["paper"]:
        assert abs(row["full_error"]) <= 0.15 and abs(row["speedup_error"]) <= 0.35, row
    assert doc["paper_within_bounds"] == {"full_15pct": True, "vericache_35pct": True}
    gpus = {p["hardware"].split(" (")[0] for p in doc["gpus"]}
    assert {"H200", "GH200 144GB", "L40S", "RTX PRO 6000 Blackwell"} <= gpus or not doc["alphas"]


def test_a_finite_trace_is_served_row_by_row_with_its_rows_acceptance_and_the_overheads():
    """(issue 41, item 1) A finite trace: each row with its own acceptance, the measured overheads on every
    VeriCache step (per step, per verification), the trace ending when its slowest row does. By hand: two rows at
    horizon 1 emit (1 + a) / 2 tokens a step; both running, one verifies a step; alone, half a verification."""
    hw = C.Hardware("toy", 1e12, 1e18, 1e12, 1e15, step_overhead_s=1e-3, verify_overhead_s=4e-3)
    wl = C.Workload(2e9, 1e9, 1, 4, 1000, 1e9, max_rows=2, k_max=1, new_tokens=100, vc_row_bytes=1e8)
    p = C.predict(hw, wl, 1e-9, [0.5, 0.9], tail_full=False)
    both, alone = 2e-3 + 1e-3 + 4e-3, 2e-3 + 1e-3 + 0.5 * 4e-3  # weights (2 ms) + overheads
    fast = 100 / 0.95  # steps until the a = 0.9 row is done; the a = 0.5 row has done 0.75 of them
    assert p.vc_rows == 2 and p.vc_horizon == 1
    assert p.vc_tokens_per_s == pytest.approx(200 / (fast * both + (100 - 0.75 * fast) / 0.75 * alone), rel=1e-4)
    mean = C.predict(hw, wl, 1e-9, 0.7, tail_full=False)  # one figure for both rows: both end together
    assert mean.vc_tokens_per_s == pytest.approx(200 / (100 / 0.85 * both), rel=1e-4)
    assert mean.vc_tokens_per_s > p.vc_tokens_per_s
    bare = C.predict(C.Hardware("toy", 1e12, 1e18, 1e12, 1e15), wl, 1e-9, [0.5, 0.9], tail_full=False)
    assert bare.vc_tokens_per_s > p.vc_tokens_per_s  # the overheads cost
    with pytest.raises(ValueError, match="every alpha in"):
        C.predict(hw, wl, 0.5, [0.5, 1.5])


@pytest.mark.parametrize("budget", [0.5, 0.75])
def test_the_model_sizes_rows_as_the_scheduler_admits_them(tiny, budget):
    """(issue 41, item 2) capacity.for_trace counts a row's bytes by the scheduler's formula (engine/sizes.py): the
    rows it predicts at once are the rows the engine admits at once, on full KV and with VeriCache."""
    eng = tiny[0]
    prompts = [[(i + j) % 256 for j in range(384)] for i in range(4)]
    mc = eng.model.cfg
    total = int(budget * sum((len(p) + 4) * mc.kv_bytes_per_token(4) for p in prompts))
    hw = C.Hardware("cpu (test figures)", 2e10, 1e11, 1e9, 1e12)
    reqs = [Request(f"r{i}", p, 4) for i, p in enumerate(prompts)]
    rows = {}
    for policy in ("full", "vericache"):
        cfg = ServingConfig(policy=policy, budget_bytes=total, compressor="kivi2", k_max=8, planner=False)
        engine = ServingEngine(eng.model, cfg)
        rows[policy] = engine.run(reqs).max_concurrent
    pred = C.for_trace(
        ServingEngine(eng.model, ServingConfig(budget_bytes=total, compressor="kivi2", k_max=8)), reqs, 0.8, hw
    )
    assert (pred.full_rows, pred.vc_rows) == (rows["full"], rows["vericache"])
    assert rows["vericache"] > rows["full"] >= 1
