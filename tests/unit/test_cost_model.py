"""The cost model's maths on hand-computed cases (no model, no torch)."""

import json

import pytest

from benchmarks import cost_model as cm  # dataclasses look their module up: a real import

# 1e12 B/s HBM, no compute limit; 1e9 params (2e9 weight bytes); 1000 B of KV per token; 1e6 tokens = 1e9 B.
HW = cm.Hardware("toy", hbm_bytes_per_s=1e12, flops=1e18, hbm_bytes=1e12)
M = cm.Model("toy", params=1e9, layers=1, kv_heads=1, head_dim=250)
LINK = cm.Link("toy", 1e9)
D = cm.Drafting("c", k=4, accepted=3.0, compression=0.5, k_max=32)
W = cm.Workload(context=1_000_000, batch=1, new_tokens=100)


def test_model_figures():
    assert M.kv_bytes_per_token == 1000 and M.weight_bytes == 2e9
    assert cm.MODELS["llama3-8b"].kv_bytes_per_token == 128 * 1024
    assert cm.MODELS["qwen3-32b"].kv_bytes_per_token == 256 * 1024
    assert cm.MODELS["llama3.3-70b"].kv_bytes_per_token == 320 * 1024


def test_steps_and_decode_speedup():
    p = cm.predict(HW, M, LINK, D, W)
    assert p.full_step_ms == pytest.approx(3.0)  # (2e9 + 1e9) / 1e12
    assert p.draft_step_ms == pytest.approx(2.5)  # (2e9 + 0.5e9) / 1e12
    assert p.verify_step_ms == pytest.approx(3.0)  # memory bound: 5 tokens read the same bytes
    assert p.vc_token_ms == pytest.approx(3.25)  # (4 * 2.5 + 3) / (3 + 1)
    assert p.decode_speedup == pytest.approx(3 / 3.25)
    assert p.fits


def test_transfer_overlap_same_link():
    p = cm.predict(HW, M, LINK, D, W)
    assert p.transfer_full_s == pytest.approx(1.0)
    assert p.ttft_full_s == pytest.approx(1.003)
    assert p.e2e_full_s == pytest.approx(1.3)  # 1 s fetch + 100 x 3 ms
    # compressed copy 0.5 s, then the full copy until 1.5 s; 32 drafts (k_max) fit in the gap; verify 3 ms
    assert p.ttft_vc_s == pytest.approx(1.503)
    # round 1 emits min(32, 3/4 * 32) + 1 = 25 tokens; 75 more at 3.25 ms
    assert p.e2e_vc_s == pytest.approx(1.503 + 75 * 0.00325)
    assert p.e2e_speedup == pytest.approx(1.3 / (1.503 + 75 * 0.00325))


def test_transfer_overlap_separate_path():
    w = cm.Workload(context=1_000_000, batch=1, new_tokens=100, compressed_local_bytes_per_s=1e10)
    p = cm.predict(HW, M, LINK, D, w)
    # compressed copy in 0.05 s over its own path; full copy in at 1.0 s, not delayed
    assert p.ttft_vc_s == pytest.approx(1.003)
    assert p.e2e_vc_s == pytest.approx(1.003 + 75 * 0.00325)


def test_compute_bound_verify_and_tp():
    hw = cm.Hardware("slow-compute", 1e12, flops=1e12, hbm_bytes=1e12)
    p = cm.predict(hw, M, LINK, D, W)
    assert p.verify_step_ms == pytest.approx(10.0)  # 2 * 1e9 * 5 tokens / 1e12 > 3 ms of reads
    m2 = cm.Model("toy-tp2", params=1e9, layers=1, kv_heads=1, head_dim=250, tp=2)
    assert cm.predict(HW, m2, LINK, D, W).full_step_ms == pytest.approx(1.5)


def test_kv_dominated_speedup():
    m = cm.Model("tiny-weights", params=1e6, layers=1, kv_heads=1, head_dim=250)
    d = cm.Drafting("c", k=4, accepted=4.0, compression=0.25)
    p = cm.predict(HW, m, LINK, d, W)
    assert p.decode_speedup == pytest.approx(1.002 / ((4 * 0.252 + 1.002) / 5))


def test_acceptance_capped_at_k():
    d = cm.Drafting("c", k=4, accepted=9.0, compression=0.5)  # e.g. a long round 1 counted in
    assert cm.predict(HW, M, LINK, d, W).vc_token_ms == pytest.approx((4 * 2.5 + 3) / 5)


def test_does_not_fit():
    w = cm.Workload(context=1_000_000, batch=1000, new_tokens=1)
    assert not cm.predict(HW, M, LINK, D, w).fits


def test_load_measured_rescales_quantizers(tmp_path):
    rows = [
        {"method": "vericache", "compressor": "kivi4", "k": "8", "accepted": 6.0, "bytes_ratio": 0.18},
        {"method": "vericache", "compressor": "kivi4", "k": "8", "accepted": 7.0, "bytes_ratio": 0.18},
        {"method": "vericache", "compressor": "snapkv-4x", "k": "8", "accepted": 5.0, "bytes_ratio": 0.25},
        {"method": "vericache", "compressor": "snapkv-4x", "k": "adaptive", "accepted": 9.0},
        {"method": "full-kv", "compressor": "-", "k": "-", "accepted": None},
    ]
    f = tmp_path / "results.json"
    f.write_text(json.dumps({"kv_bytes_per_token": 46080, "rows": rows}))
    got = {d.compressor: d for d in cm.load_measured(f)}
    assert got["kivi4"].accepted == pytest.approx(6.5) and got["kivi4"].compression == pytest.approx(0.36)
    assert got["snapkv-4x"].compression == pytest.approx(0.25) and got["snapkv-4x"].k == 8
    assert cm.accepted_at(got["kivi4"], 16) == pytest.approx(13.0)
    assert cm.accepted_at(cm.Drafting("c", 8, 8.0, 0.5), 32) == 32
