"""A finished vllm_bench.py run read back from its results folder (what ngram_replay.py replays): a run's generated
texts from results.json, and the prompts, from the dataset under logs/ or, where the raw files are gone (a
checkout: logs/ is out of git), rebuilt from the run's own arguments and checked against its recorded digest."""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

from benchmarks.vllm_load.grid import REFERENCE
from benchmarks.vllm_load.workload import DEFAULT, WORKLOADS, build_workload, dataset_bytes


def load(folder: Path) -> dict:
    path = Path(folder) / "results.json"
    if not path.is_file():
        raise ValueError(f"{folder} has no results.json (a results/vllm_bench/<stamp> folder)")
    return json.loads(path.read_text())


def run_name(row: dict) -> str:
    """r<round>-c<concurrency>-<link>-<configuration>: what the run's raw files were named after."""
    return Path(row.get("client_json") or "?").stem


def texts_of(doc: dict, name: str | None = None) -> tuple[str, list[str]]:
    """(run name, generated texts) of the run `name` (default: the reference configuration's at the highest
    concurrency, last round); texts a run did not keep are those of a run with the same digests."""
    runs = [r for r in doc["runs"] if r.get("client")]
    if name is None:
        ref = REFERENCE[doc["args"].get("topology", "single")]
        refs = [r for r in runs if r["configuration"] == ref]
        if not refs:
            raise ValueError(f"no {ref} run with a client answer: name one with --client")
        row = max(refs, key=lambda r: (r["concurrency"], r["round"]))
    else:
        row = next((r for r in runs if run_name(r) == Path(name).stem), None)
        if row is None:
            raise ValueError(f"no run {name!r}; runs: {', '.join(run_name(r) for r in runs)}")
    digests = row["client"].get("text_digests")
    same = [r["client"] for r in runs if r["client"].get("text_digests") == digests]
    texts = row["client"].get("generated_texts") or next(
        (c["generated_texts"] for c in same if "generated_texts" in c), None
    )
    if texts is None:
        raise ValueError(f"{run_name(row)} kept no generated texts, nor did a run with the same texts")
    return run_name(row), texts


def prompts_of(folder: Path, doc: dict, tokenizer) -> list[str]:
    """The prompts in the order the client sent them: logs/dataset.jsonl (or an older run's dataset.jsonl), else
    rebuilt from the run's arguments (the workload is deterministic) and checked against the recorded digest."""
    for path in (Path(folder) / "logs" / "dataset.jsonl", Path(folder) / "dataset.jsonl"):
        if path.is_file():
            return [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]
    args = argparse.Namespace(**doc["args"])
    work = build_workload(
        args,
        WORKLOADS[getattr(args, "workload", DEFAULT)].texts(),
        lambda t: tokenizer(t).input_ids,
        lambda ids: tokenizer.decode(ids),
        doc["workload"]["chunk"],
    )
    want = (doc["workload"].get("dataset") or {}).get("sha1")
    if want is not None and hashlib.sha1(dataset_bytes(work, args.new)).hexdigest() != want:
        raise ValueError(f"the dataset rebuilt from {folder}'s arguments differs from the run's (sha1 {want})")
    return [r["prompt"] for r in work.requests]
