"""CompressedKVProposer warns at start on the CPU: the measured slowdown (traced to a results folder of
benchmarks/vllm_serve.py) and how to turn it off. A minimal fake vllm_config; no server, no model."""

from __future__ import annotations

import json
import logging
import re
from types import SimpleNamespace

import pytest
import torch

from paths import ROOT, load_benchmark

pytest.importorskip("vllm")

from vericache_connector.integration.vllm import proposer as proposer_mod  # noqa: E402


def fake_vllm_config() -> SimpleNamespace:
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=8),
        model_config=SimpleNamespace(max_model_len=2048, model="/nonexistent/model"),
    )


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def start_proposer(monkeypatch, cuda: bool) -> list[logging.LogRecord]:
    """Construct the proposer with CUDA reported (un)available; the warnings its logger emitted."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    handler = Records()
    proposer_mod.logger.addHandler(handler)  # vLLM's logger does not propagate to the root (caplog)
    try:
        p = proposer_mod.CompressedKVProposer(fake_vllm_config())
    finally:
        proposer_mod.logger.removeHandler(handler)
    p._pool.shutdown()
    assert p.device == ("cuda" if cuda else "cpu") and p.model is None  # no model loaded at construction
    return [r for r in handler.records if r.levelno >= logging.WARNING]


def test_cpu_start_warns_with_the_measured_slowdown_and_the_off_switch(monkeypatch):
    (record,) = start_proposer(monkeypatch, cuda=False)
    msg = record.getMessage()
    assert msg == proposer_mod.cpu_warning()
    assert "drop --speculative-config" in msg
    assert "slower" in msg and "benchmarks/vllm_serve.py" in msg
    # the figures come from the cited run: recompute them from its results.json with the benchmark's own summary
    run = re.search(r"results/vllm_serve/\d{8}-\d{6}", msg)
    assert run is not None, msg
    results = ROOT / run.group(0) / "results.json"
    assert results.is_file(), results
    rows = json.loads(results.read_text())["rows"]
    configs = {c["configuration"]: c for c in load_benchmark("vllm_serve").summarize(rows)}
    warm, connector = configs["connector + proposer warm"], configs["connector warm"]
    assert warm["total_vs_connector"] > 1  # a slowdown is what the warning claims
    assert f"{warm['total_vs_connector']:.2f}x the end-to-end time of the connector alone" in msg
    assert f"({warm['total_vs_base']:.2f} vs {connector['total_vs_base']:.2f} of plain vLLM's)" in msg
    assert f"{warm['ttft_vs_connector']:.2f}x its time to first token" in msg


def test_no_cpu_warning_when_the_draft_model_runs_on_cuda(monkeypatch):
    assert start_proposer(monkeypatch, cuda=True) == []
