"""benchmarks/view_step_time.py's bookkeeping without vLLM: its grid's bounds, a row's figures from step samples,
and a table that says NO where a drafted output differed from the plain one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks import view_step_time as V


def test_the_grid_is_checked():
    assert V.parse_args([]).contexts == [1792, 6400]
    for bad in (["--contexts", "8000"], ["--batches", "0"], ["--drafts", "0"], ["--steps", "2"]):
        with pytest.raises(SystemExit):
            V.parse_args(bad)


def test_a_row_from_its_step_samples():
    proposer = SimpleNamespace(acceptance=SimpleNamespace(accepted={"compressed": 30}), stats={"drafted": 40})
    row = V.entry(6400, 8, 4, [[1, 2]], [[1, 2]], [0.200, 0.210, 0.190], [0.520], [0.050, 0.062], proposer)
    assert (row["target_step_ms"], row["draft_step_ms"], row["verify_step_ms"]) == (200.0, 56.0, 520.0)
    assert row["draft_over_target"] == pytest.approx(0.28)
    assert row["per_verified_draft_ms"] == 10.0  # (520 - 200) / (8 rows x 4 drafts)
    assert row["accepted_per_draft"] == 0.75 and row["identical"]
    assert proposer.stats["drafted"] == 0  # counted per row
    differing = V.entry(6400, 1, 4, [[1, 2]], [[1, 3]], [0.05], [0.07], [0.04], proposer)
    doc = {"args": vars(V.parse_args([])), "load_avg": {"before": [0.5, 0.5, 0.5]}, "summary": [row, differing]}
    for r in doc["summary"]:
        r["drafted_over_plain_speed"] = 0.9
    text = V.table(doc)
    assert "| 6400 | 8 | 200.0 | 56.0 | 0.28 | 520.0 (4) | 10.0 | 0.75 | 0.90 | yes |" in text
    assert text.count("| NO |") == 1
