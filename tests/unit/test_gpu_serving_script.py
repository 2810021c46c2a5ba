"""benchmarks/gpu_serving.py (the device check of the serving scheduler) runs end to end on the CPU with a
tiny random model, so it does not rot between device calls; without CUDA and --smoke it refuses."""

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
