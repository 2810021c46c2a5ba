"""benchmarks/gpu_serving.py (every GPU check of the serving engine in one call) runs end to end on the CPU with a
tiny random model, so it does not rot between device calls: its kernel checks (the fused CPU kernel in place of
Triton, which tests/unit/test_kernels_paged_packed.py runs under the interpreter) and its serving runs (full KV,
a token dropper with complement reloads, kivi4 packed); without CUDA and --smoke it refuses."""

from __future__ import annotations

import json

import pytest
import torch

from paths import load_benchmark


def test_gpu_serving_dry_run(capsys):
    mod = load_benchmark("gpu_serving")
    assert mod.main(["--smoke", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {r["policy"]: r for r in doc["rows"]}
    assert set(rows) == {"full", "vericache"} and rows["full"]["ratio_vs_full"] == 1.0
    assert rows["vericache"]["verifications"] > 0 and rows["vericache"]["reload_failures"] == 0
    assert all(r["peak_resident_bytes"] <= r["budget_bytes"] for r in rows.values())
    assert "replayed" in doc["note"] and doc["acceptance"]
    assert doc["kernels_ok"] and {k["case"].split()[1] for k in doc["kernels"]} == {"kivi4", "kivi2", "int8", "fp8"}
    vc = {r["compressor"]: r for r in doc["rows"] if r["policy"] == "vericache"}
    assert vc["snapkv-4x"]["complement"] and vc["kivi4"]["draft_layout"] == "packed"
    assert all(r["verifications"] > 0 and r["mean_verify_step_ms"] > 0 for r in vc.values())
    # (issue 41, item 4) each VeriCache row beside the capacity model's prediction for it (an H200's figures here)
    assert all(r["predicted_speedup"] > 0 and r["model_hardware"].startswith("H200") for r in vc.values())


def test_replay_follows_the_recorded_rounds():
    mod = load_benchmark("gpu_serving")
    replay = mod.Replay([[3, 5], [0]])
    a, b = type("S", (), {"request_id": "a"}), type("S", (), {"request_id": "b"})
    assert [replay(a, 8), replay(a, 4), replay(a, 8), replay(b, 8)] == [3, 4, 3, 0]


def test_refuses_without_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is here: the script runs instead of refusing")
    assert load_benchmark("gpu_serving").main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err
