"""benchmarks/serving.py's results.json: every row in the summary with the link it ran at and the machine's load
average beside its throughput and ratio (issue 27), and its output saying the budget and link are emulated."""

from __future__ import annotations

import argparse
import json

from benchmarks.kit.load import LoadAverage
from benchmarks.kit.results import Results

from paths import load_benchmark


def row(policy, sweep="budget", link=0.5, tps=10.0, load=0.3):
    return {
        "policy": policy,
        "sweep": sweep,
        "budget_fraction": 0.25,
        "rate": None,
        "link_gbps": link,
        "tokens_per_s": tps,
        "identical": True,
        "identical_n": 6,
        "requests": 6,
        "mean_accepted": 0.0 if policy == "full" else 20.0,
        "load_avg": load,
        "max_concurrent": 1,
        "mean_latency_s": 1.0,
        "p90_latency_s": 1.0,
        "mean_ttft_s": 1.0,
        "link_utilization": 0.0,
        "peak_resident_bytes": 1,
        "draft_step_s": 0.0,
        "verify_step_s": 0.0,
        "decode_step_s": 0.0,
        "link_wait_s": 0.0,
        "idle_s": 0.0,
        "served_policy": policy,
    }


def test_summary_carries_link_and_load_average(tmp_path):
    mod = load_benchmark("serving")
    args = argparse.Namespace(
        link_gbps=0.5, links=[0.08], requests=6, min_tokens=4096, max_tokens=8192, new=64, compressor="kivi4", k_max=64
    )
    rows = [row("full", tps=10.0), row("vericache", tps=25.0), row("vericache", sweep="link", link=0.08, tps=12.0)]
    ctx = dict(demand=1, prompts=[[1] * 5000], prefill_s=[1.0], cmd="python benchmarks/serving.py", threads=1)
    ctx["load"] = LoadAverage().start()
    mod.write(Results(tmp_path, ctx["cmd"]), rows, args, ctx, complete=True)
    doc = json.loads((tmp_path / "results.json").read_text())
    summary = {(r["sweep"], r["policy"]): r for r in doc["summary"]}
    assert summary[("budget", "vericache")]["ratio_vs_full"] == 2.5
    assert summary[("link", "vericache")]["ratio_vs_full"] == 1.2  # against the budget sweep's full-KV row
    assert summary[("link", "vericache")]["link_gbps"] == 0.08 and summary[("budget", "full")]["link_gbps"] is None
    assert all(r["load_avg"] == 0.3 for r in doc["summary"]) and len(doc["load_avg"]["before"]) == 3  # 1, 5, 15 min
    assert "EMULATED" in doc["proxy"] and "byte cap" in doc["proxy"]
    assert "EMULATED" in (tmp_path / "table.md").read_text()


def test_capacity_model_rows_say_what_it_predicted_and_served(tmp_path):
    """--fallback both: a VeriCache row run as measured and one the capacity model served, told apart."""
    mod = load_benchmark("serving")
    args = argparse.Namespace(
        link_gbps=0.5, links=[], requests=6, min_tokens=4096, max_tokens=8192, new=64, compressor="kivi4", k_max=64
    )
    planned = {**row("vericache", tps=9.9), "capacity_model": True, "predicted_speedup": 0.8, "served_policy": "full"}
    rows = [row("full", tps=10.0), row("vericache", tps=7.0), planned]
    ctx = dict(demand=1, prompts=[[1] * 5000], prefill_s=[1.0], cmd="python benchmarks/serving.py", threads=1)
    ctx["load"] = LoadAverage().start()
    mod.write(Results(tmp_path, ctx["cmd"]), rows, args, ctx, complete=True)
    summary = json.loads((tmp_path / "results.json").read_text())["summary"]
    assert [(r["capacity_model"], r["served_policy"]) for r in summary[1:]] == [(False, "vericache"), (True, "full")]
    assert summary[2]["predicted_speedup"] == 0.8 and abs(summary[2]["ratio_vs_full"] - 0.99) < 1e-9
    assert "vericache + planner + guard (0.80x: served full)" in (tmp_path / "table.md").read_text()


def test_the_sweep_says_where_vericache_beats_full_kv(tmp_path):
    """(issue 41, item 3) Per budget and link: full KV, VeriCache alone and with the planner and guard, and where
    VeriCache beats full KV by how much; a budget that holds no full-KV request is one VeriCache alone serves."""
    mod = load_benchmark("serving")
    args = argparse.Namespace(
        link_gbps=0.5, links=[0.08], requests=6, min_tokens=4096, max_tokens=6144, new=64, compressor="kivi4", k_max=64
    )
    small = dict(budget_fraction=0.1, fits=False, error="more than the whole budget", tokens_per_s=0.0)
    guarded = {**row("vericache", tps=9.9), "capacity_model": True, "predicted_speedup": 0.8, "served_policy": "full"}
    rows = [
        {**row("full"), **small},
        {**row("vericache", tps=4.0), "budget_fraction": 0.1},
        {**row("vericache"), **small, "capacity_model": True},
        row("full", tps=10.0),
        row("vericache", tps=7.0),
        guarded,
        {**row("vericache", sweep="link", link=0.08, tps=12.0), "capacity_model": True, "served_policy": "vericache"},
    ]
    ctx = dict(demand=1, prompts=[[1] * 5000], prefill_s=[1.0], cmd="python benchmarks/serving.py", threads=1)
    ctx["load"] = LoadAverage().start()
    doc = mod.write(Results(tmp_path, ctx["cmd"]), rows, args, ctx, complete=True)
    assert doc["wins"] == [
        {
            "budget_fraction": 0.1,
            "link_gbps": 0.5,
            "full_tokens_per_s": None,
            "alone": "∞",
            "alone_served": "vericache",
            "guarded": None,
            "guarded_served": "does not fit",
        },
        {
            "budget_fraction": 0.25,
            "link_gbps": 0.5,
            "full_tokens_per_s": 10.0,
            "alone": 0.7,
            "alone_served": "vericache",
            "guarded": 0.99,
            "guarded_served": "full",
        },
        {
            "budget_fraction": 0.25,
            "link_gbps": 0.08,
            "full_tokens_per_s": 10.0,
            "guarded": 1.2,
            "guarded_served": "vericache",
        },
    ]
    text = (tmp_path / "table.md").read_text()
    assert "| 0.1 | 0.5 | does not fit | ∞ | - | does not fit |" in text
    assert "| 0.25 | 0.5 | 10.00 | 0.70x | 0.99x | full |" in text
    assert "VeriCache beats full KV at (budget, link GB/s): (0.1, 0.5), (0.25, 0.08)" in text
    assert "With the planner and guard, VeriCache / full KV is 0.99x at worst" in text
    assert "does not fit the budget" in text
