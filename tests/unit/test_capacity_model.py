"""The capacity model (benchmarks/capacity_model.py) on hand-computed cases, and cost_model.py --serving on a
synthetic serving run (no model, no torch)."""

import json

import pytest

from benchmarks import capacity_model as cap
from benchmarks import cost_model as cm

# 1e12 B/s HBM, no compute limit; 2e9 weight bytes; 4 layers x 1 KV head x 125 dims x 2 B x (K, V) = 2000 B/token.
HW = cm.Hardware("toy", hbm_bytes_per_s=1e12, flops=1e18, hbm_bytes=1e12)
M = cm.Model("toy", params=1e9, layers=4, kv_heads=1, head_dim=125)
CTX = 500_000  # 1e9 B of KV per request


def test_fit_alpha_inverts_the_geometric_sum():
    for a, k in [(0.5, 8), (0.9, 16), (0.97, 40)]:
        accepted = sum(a**i for i in range(1, k + 1))
        assert cap.fit_alpha(k, accepted) == pytest.approx(a, abs=1e-9)
    assert cap.tokens_per_verify(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)


def test_full_kv_rows_and_throughput_by_hand():
    p = cap.predict_serving(HW, M, 1e15, CTX, budget_bytes=4.5e9, compression=0.25, alpha=0.0)
    assert p.full_rows == 4  # floor(4.5e9 / 1e9)
    # one step reads the weights and 4 rows' KV: (2e9 + 4e9) / 1e12 = 6 ms, 4 tokens a step
    assert p.full_step_ms == pytest.approx(6.0)
    assert p.full_tokens_per_s == pytest.approx(4 / 6e-3)
    # staging: 2 of 4 layers of one request = 0.5e9; (4.5e9 - 0.5e9) / (0.25 x 1e9) = 16 compressed rows
    assert p.vc_rows == 16
    # alpha = 0: every verification emits one token, so the shortest horizon is best
    assert p.vc_horizon == 1


def test_link_bound_and_the_link_term():
    slow = cap.predict_serving(HW, M, 1e9, CTX, 4.5e9, 0.25, alpha=0.9)
    fast = cap.predict_serving(HW, M, 1e12, CTX, 4.5e9, 0.25, alpha=0.9)
    assert slow.link_bound and not fast.link_bound
    # link-bound: 1e9 B/s / 1e9 B per reload = one verification a second, E(x) tokens each
    assert slow.vc_tokens_per_s == pytest.approx(cap.tokens_per_verify(0.9, slow.vc_horizon))
    assert fast.speedup > slow.speedup


def test_rows_capped_by_the_trace():
    p = cap.predict_serving(HW, M, 1e12, CTX, 4.5e9, 0.25, alpha=0.9, max_rows=6)
    assert p.vc_rows == 6


def serving_run(tmp_path):
    """A results.json shaped as benchmarks/serving.py writes it: 6 requests of ~4096 tokens, budget 0.25."""
    kv = cm.Model("x", 134.5e6, 30, 3, 64, bytes_per_param=4, kv_bytes_per_elem=4).kv_bytes_per_token
    demand = 6 * (4096 + 64) * kv
    common = {"sweep": "budget", "budget_fraction": 0.25, "steps": 384, "decode_step_s": 40.0}
    rows = [
        {**common, "policy": "full", "tokens_per_s": 3.0, "max_concurrent": 1, "mean_accepted": 0.0},
        {
            **common,
            "policy": "vericache",
            "tokens_per_s": 9.0,
            "max_concurrent": 6,
            "mean_accepted": 7.5,
            "verify_steps": 40,
            "draft_step_s": 30.0,
        },
    ]
    doc = {
        "rows": rows,
        "demand_bytes": demand,
        "prompt_tokens": [4096] * 6,
        "args": {"link_gbps": 0.5, "compressor": "snapkv-4x", "k_max": 64},
    }
    path = tmp_path / "results.json"
    path.write_text(json.dumps(doc))
    return path


def test_cost_model_checks_a_serving_run_then_predicts_the_h200(tmp_path, capsys):
    out = tmp_path / "out"
    assert cm.main(["--serving", str(serving_run(tmp_path)), "--out", str(out), "--json"]) == 0
    doc = json.loads(next(out.glob("*/results.json")).read_text())
    (check,) = doc["checks"]
    assert check["measured_speedup"] == pytest.approx(3.0)
    assert check["predicted_full_rows"] == 1  # 0.25 of 6 requests' KV holds one
    assert 1 < check["predicted_vc_rows"] <= 6  # the trace has 6 requests
    # calibrated from the runs: the full run's steps give the bandwidth, VeriCache's draft steps the compute
    assert check["alpha"] == pytest.approx(7.5 / 8.5)  # geometric rounds: mean a / (1 - a) = 7.5
    assert check["cpu_flops"] == pytest.approx(2 * 134.5e6 * 6 / (30.0 / (384 - 40)))
    h200 = doc["summary"]
    assert {(p["link_gbps"], p["context"]) for p in h200} == {(64, 32768), (64, 131072), (450, 32768), (450, 131072)}
    for p in h200:
        assert p["full_rows"] >= 1 and p["vc_rows"] > p["full_rows"]
    assert (next(out.glob("*/table.md"))).read_text().startswith("Capacity model")
