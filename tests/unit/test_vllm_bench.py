"""benchmarks/vllm_bench.py without vLLM: its arguments, workload, plan, client command, log counts and summary
on fakes (no server, no model)."""

from __future__ import annotations

import sys

import pytest

from benchmarks import vllm_bench
from benchmarks.vllm_load import client, configs, grid, report, summary, workload
from benchmarks.vllm_load import logs as server_logs

NEW = 4
TEXTS = ["alpha beta", "gamma delta", "alpha beta", "epsilon zeta"]


def fake_client(texts, ttft_ms=100.0, throughput=50.0, lens=None):
    """What vllm.benchmarks.serve saves with --save-detailed (the keys the summary reads)."""
    n = len(texts)
    return {
        "completed": n,
        "failed": 0,
        "output_throughput": throughput,
        "mean_ttft_ms": ttft_ms,
        "p90_ttft_ms": ttft_ms * 2,
        "mean_tpot_ms": 20.0,
        "mean_e2el_ms": ttft_ms + 20.0 * (NEW - 1),
        "p90_e2el_ms": 2 * (ttft_ms + 20.0 * (NEW - 1)),
        "generated_texts": list(texts),
        "output_lens": lens or [NEW] * n,
        "input_lens": [300, 310, 300, 320][:n],
        "errors": [""] * n,
    }


def run_row(config, client, concurrency=1, gbits=None, hits=0):
    logs = server_logs.log_stats(
        "".join(f"hit r{i}: 256 tokens loaded (compressed copy after -, full after 0.50s)\n" for i in range(hits))
    )
    return {
        "round": 0,
        "concurrency": concurrency,
        "gbits": gbits,
        "configuration": config,
        "client": client,
        "client_json": f"/fake/{config}.json",
        "logs": logs,
        "load_avg": 1.5,
    }


def summarize(configs, runs, gbits=(0.4,), concurrency=(1,)):
    args = vllm_bench.parse_args(
        ["--configs", *configs, "--gbits", *map(str, gbits), "--concurrency", *map(str, concurrency), "--new", str(NEW)]
    )
    workload = {"requests": len(TEXTS), "documents": []}
    return summary.summarize(args, runs, workload, {"before": (1.0, 1.0, 1.0), "after": (2.0, 2.0, 2.0)}, "cmd")


def by_config(result):
    return {s["configuration"]: s for s in result["summary"]}


def test_summary_keys_ratios_and_identical():
    runs = [
        run_row("plain vLLM", fake_client(TEXTS, ttft_ms=400, throughput=40)),
        run_row("connector", fake_client(TEXTS, ttft_ms=100, throughput=50), gbits=0.4, hits=2),
        run_row("connector + proposer", fake_client(TEXTS, ttft_ms=200, throughput=60), gbits=0.4, hits=2),
    ]
    result = summarize(["plain vLLM", "connector", "connector + proposer"], runs)
    got = by_config(result)
    for s in result["summary"]:
        for key in (
            "configuration",
            "concurrency",
            "gbits",
            "output_throughput",
            "mean_ttft_s",
            "p90_ttft_s",
            "mean_tpot_ms",
            "mean_e2e_s",
            "identical",
            "load_avg",
        ):
            assert key in s, key
        assert s["gbits"] == 0.4 and s["concurrency"] == 1 and s["load_avg"] == 1.5
    assert all(s["identical"] is True for s in result["summary"])
    assert got["connector + proposer"]["x_best_alternative"] == pytest.approx(60 / 50)
    assert got["connector"]["x_best_alternative"] == pytest.approx(1.0)
    assert got["plain vLLM"]["x_best_alternative"] == pytest.approx(40 / 50)
    assert got["connector + proposer"]["best_alternative"] == "connector"
    assert got["connector"]["ttft_vs_plain"] == pytest.approx(0.25)
    assert got["connector"]["mean_ttft_s"] == pytest.approx(0.1) and got["connector"]["p90_ttft_s"] == pytest.approx(
        0.2
    )
    assert got["connector"]["hits"] == 2 and got["connector"]["mean_load_s"] == pytest.approx(0.5)
    assert result["runs"][1]["client_json"] == "/fake/connector.json"
    # per run: the client's figures per request and a digest per text; the texts themselves where a reader needs
    # them (the reference run's; a run's that differ)
    plain, conn = result["runs"][0]["client"], result["runs"][1]["client"]
    assert plain["generated_texts"] == TEXTS and "generated_texts" not in conn
    assert conn["text_digests"] == plain["text_digests"] and conn["input_lens"] == [300, 310, 300, 320]
    assert conn["mean_ttft_ms"] == 100 and "itls" not in conn
    table = report.table(result)
    assert "EMULATED" in table and "1.20x the best alternative (connector)" in table
    assert "connector TTFT / plain TTFT 0.25" in table


def test_one_differing_text_makes_identical_false():
    changed = list(TEXTS)
    changed[2] = "alpha beta!"
    runs = [
        run_row("plain vLLM", fake_client(TEXTS)),
        run_row("connector", fake_client(changed), gbits=0.4),
    ]
    result = summarize(["plain vLLM", "connector"], runs)
    got = by_config(result)
    assert got["plain vLLM"]["identical"] is True
    assert got["connector"]["identical"] is False
    assert got["connector"]["differing_requests"] == [2]
    assert result["runs"][1]["client"]["generated_texts"] == changed  # a differing run keeps its texts


def test_short_or_reordered_answers_are_not_identical():
    short = fake_client(TEXTS, lens=[NEW, NEW, NEW - 1, NEW])
    reordered = fake_client(TEXTS)
    reordered["input_lens"] = list(reversed(reordered["input_lens"]))
    for other in (short, reordered, None):
        runs = [run_row("plain vLLM", fake_client(TEXTS)), run_row("connector", other, gbits=0.4)]
        assert by_config(summarize(["plain vLLM", "connector"], runs))["connector"]["identical"] is False


def test_plain_rows_repeat_under_every_link_and_compare_with_the_first_concurrency():
    runs = [
        run_row("plain vLLM", fake_client(TEXTS), concurrency=1),
        run_row("plain vLLM", fake_client(TEXTS[:3] + ["other"]), concurrency=2),
        *[run_row("connector", fake_client(TEXTS), concurrency=c, gbits=g) for c in (1, 2) for g in (0.1, 0.4)],
    ]
    result = summarize(["plain vLLM", "connector"], runs, gbits=(0.1, 0.4), concurrency=(1, 2))
    keys = [(s["gbits"], s["concurrency"], s["configuration"]) for s in result["summary"]]
    assert len(keys) == len(set(keys)) == 8
    plain = {
        (s["gbits"], s["concurrency"]): s["identical"] for s in result["summary"] if s["configuration"] == "plain vLLM"
    }
    assert plain == {(0.1, 1): True, (0.4, 1): True, (0.1, 2): False, (0.4, 2): False}
    # the connector at concurrency 2 against plain vLLM at concurrency 2 (which differs from the connector's)
    conn = {
        (s["gbits"], s["concurrency"]): s["identical"] for s in result["summary"] if s["configuration"] == "connector"
    }
    assert conn == {(0.1, 1): True, (0.4, 1): True, (0.1, 2): False, (0.4, 2): False}


def test_plan_workload_and_client_command(tmp_path):
    args = vllm_bench.parse_args(["--configs", "plain", "connector", "connector + proposer", "--concurrency", "4", "1"])
    assert args.configs == ["plain vLLM", "connector", "connector + proposer"]
    assert (args.documents, args.doc_tokens, args.questions, args.new, args.compressor) == (4, 1800, 4, 64, "split16")
    assert (args.spec_k, args.ngram_k, args.gbits) == (32, 8, [0.1, 0.4])
    runs = grid.plan_runs(args)
    assert [r.name for r in runs[:3]] == [
        "r0-c1-nolink-plain",
        "r0-c1-0.1gbit-connector",
        "r0-c1-0.1gbit-connector-proposer",
    ]
    assert len(runs) == 2 * (1 + 2 * 2)
    with pytest.raises(SystemExit):
        vllm_bench.parse_args(["--configs", "nope"])

    # a fake tokenizer: one token per character; the store's chunk is 8 tokens
    args = vllm_bench.parse_args(["--documents", "2", "--doc-tokens", "20", "--questions", "3"])
    texts = {"short": "x" * 10, "a": "a" * 40, "b": "b" * 30, "c": "c" * 50}
    work = workload.build_workload(args, texts, list, "".join, chunk=8)
    assert [d["name"] for d in work.documents] == ["a", "b"] and work.documents[0]["stored"] == 16
    assert len(work.requests) == 6 and {(r["document"], r["question"]) for r in work.requests} == {
        (d, q) for d in "ab" for q in range(3)
    }
    assert all(r["prompt"].startswith(r["document"] * 20) for r in work.requests)
    again = workload.build_workload(args, texts, list, "".join, chunk=8)
    assert [r["prompt"] for r in again.requests] == [r["prompt"] for r in work.requests]  # fixed seed
    assert any("question tokens" in w for w in work.warnings)  # 20 + a question's tail fill a third chunk
    path = tmp_path / "d.jsonl"
    workload.write_dataset(work, path, 7)
    assert len(path.read_text().splitlines()) == 6

    cmd = client.client_command(args, "/m", "http://127.0.0.1:1", path, 6, 4, tmp_path / "r.json")
    flags = " ".join(cmd[3:])
    for want in (
        "--dataset-name custom",
        "--max-concurrency 4",
        "--num-prompts 6",
        "--temperature 0",
        "--ignore-eos",
        "--disable-shuffle",
        "--skip-chat-template",
        "--ready-check-timeout-sec 0",
        "--save-detailed",
        "--request-rate inf",
        "--metric-percentiles 90",
        f"--custom-output-len {args.new}",
    ):
        assert want in flags, want


def test_log_stats_counts():
    log = "\n".join(
        [
            "INFO hit req-1: 1792 tokens loaded (compressed copy after 0.80s, its lower halves after 1.60s, full after 1.70s)",
            "INFO hit req-2: 1792 tokens loaded (compressed copy after -, full after 6.60s)",
            "INFO VeriCache load-or-recompute: req-1: load 512 of 512 stored tokens (est. -; all -, none -); link unmeasured",
            "INFO VeriCache load-or-recompute: req-3: recompute 0 of 512 stored tokens (load 1.2 s, recompute 0.8 s)",
            "INFO VeriCache load-or-recompute: req-4: recompute (link 0.1 Gbit/s, load ahead)",
            "WARNING load of req-5 failed (TimeoutError: x): vLLM recomputes its 7 blocks",
            "INFO SpecDecoding metrics: Mean acceptance length: 2.00, Accepted: 10 tokens, Drafted: 20 tokens, x",
            "INFO SpecDecoding metrics: Mean acceptance length: 2.00, Accepted: 5 tokens, Drafted: 6 tokens, x",
            "INFO vericache.router: router: cmpl-1: 1616 prompt + 32 new tokens, verified, 10 verify calls (1.20s), "
            "accepted [2, 3, 0], 40 drafted in 2 streams, first token 0.40s, 2.50s",
            "INFO vericache.router: router: cmpl-2: 1617 prompt + 32 new tokens, fallback (drafter x: error event: "
            "EngineCore (see above), then), 0 verify calls (0.12s), accepted [], 0 drafted in 1 streams, first token "
            "8.35s, 12.65s",
            "INFO vericache.router: router: cmpl-3: 1616 prompt + 32 new tokens, direct, 0 verify calls (0.00s), "
            "accepted [], 0 drafted in 0 streams, first token 0.30s, 2.10s",
        ]
    )
    got = server_logs.log_stats(log)
    assert got["hits"] == 2 and got["loads_s"] == [1.7, 6.6] and got["loaded_tokens"] == [1792, 1792]
    assert got["decisions"] == {"load": 1, "recompute": 2}
    assert got["load_failures"] == 1 and got["spec_log_accepted_drafted"] == [15, 26]
    assert got["router_paths"] == {"verified": 1, "fallback": 1, "direct": 1}
    assert got["router_verify_calls"] == 10 and got["router_accepted"] == 5


def test_the_router_topology_passes_the_verifier_decode_slots_to_the_router_only():
    from vericache_connector.router.config import RouterConfig

    args = vllm_bench.parse_args(["--topology", "router"])
    assert args.verifier_decode_slots == RouterConfig.verifier_decode_slots  # the router's own default
    args = vllm_bench.parse_args(["--topology", "router", "--verifier-decode-slots", "0"])
    ctx = configs.Context(args, "/m", 4096)
    urls = {"verifier": "http://v", "drafter0": "http://d0", "drafter1": "http://d1"}
    router, plain = (grid.BY_NAME[name] for name in ("router", "plain-replicas"))
    assert router.router_argv(ctx, urls) == ["router", "--port", "0", "--verifier", "http://v",
                                             "--verifier-decode-slots", "0", "--drafter", "http://d0",
                                             "--drafter", "http://d1"]  # fmt: skip
    assert plain.router_argv(ctx, {"plain0": "http://p0", "plain1": "http://p1"}) == [
        "router", "--port", "0", "--verifier", "http://p0", "--verifier", "http://p1",
        "--near-verifier", "http://p0"]  # fmt: skip
    args = vllm_bench.parse_args(
        ["--topology", "router", "--verifier-decode-slots", "4", "--max-verifier-decode-slots", "4"]
    )
    assert router.router_argv(configs.Context(args, "/m", 4096), urls)[5:9] == [
        "--verifier-decode-slots", "4", "--max-verifier-decode-slots", "4"]  # fmt: skip
    with pytest.raises(SystemExit):
        vllm_bench.parse_args(["--topology", "router", "--verifier-decode-slots", "-1"])
    with pytest.raises(SystemExit):
        vllm_bench.parse_args(
            ["--topology", "router", "--verifier-decode-slots", "3", "--max-verifier-decode-slots", "2"]
        )


def test_openmp_intel_preloads_the_environments_libiomp5_for_every_server(tmp_path, monkeypatch):
    assert vllm_bench.parse_args([]).openmp == "intel"  # vLLM's CPU install guide: LD_PRELOAD libiomp5
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    with pytest.raises(SystemExit, match="libiomp5.so not found"):
        configs.openmp_env("intel")
    (tmp_path / "lib").mkdir()
    lib = tmp_path / "lib" / "libiomp5.so"
    lib.write_bytes(b"")
    assert configs.openmp_env("intel") == {"LD_PRELOAD": str(lib)}
    monkeypatch.setenv("LD_PRELOAD", "/x/libtcmalloc.so")  # kept, after ours
    assert configs.openmp_env("intel") == {"LD_PRELOAD": f"{lib}:/x/libtcmalloc.so"}
    monkeypatch.setenv("LD_PRELOAD", f"/x/libtcmalloc.so:{lib}")  # already there: as is
    assert configs.openmp_env("intel") == {"LD_PRELOAD": f"/x/libtcmalloc.so:{lib}"}
    assert configs.openmp_env("gnu") == {}
    with pytest.raises(SystemExit):
        vllm_bench.parse_args(["--openmp", "llvm"])


def test_a_libgomp_alternative_runs_without_the_intel_preload(tmp_path, monkeypatch):
    """--openmp intel preloads libiomp5 for every server; the libgomp alternatives (asked for by name) keep the
    environment's own LD_PRELOAD, so each alternative can run with its faster OpenMP runtime."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    monkeypatch.setenv("LD_PRELOAD", "/x/libtcmalloc.so")
    args = vllm_bench.parse_args(["--configs", "plain", "plain-gomp", "connector-gomp", "connector-proposer"])
    assert [c for c in args.configs] == [
        "plain vLLM",
        "connector + proposer",
        "plain vLLM, libgomp",
        "connector, libgomp",
    ]
    ctx = configs.Context(args, "/m", 4096, gbits=0.1, store_url="local:///s", name="x")
    env = {label: grid.BY_NAME[label].servers(ctx)["vllm"].env for label in args.configs}
    assert env["plain vLLM, libgomp"] == env["connector, libgomp"] == {"LD_PRELOAD": "/x/libtcmalloc.so"}
    assert env["plain vLLM"] == env["connector + proposer"] == {}  # the run's --openmp (the process environment)
    assert grid.BY_NAME["connector, libgomp"].alternative and not grid.BY_NAME["connector, libgomp"].default


def test_a_workload_is_one_entry_of_the_table_and_its_figures_are_the_flags_defaults(monkeypatch):
    args = vllm_bench.parse_args([])
    assert (args.workload, args.documents, args.doc_tokens, args.questions, args.new) == ("short", 4, 1800, 4, 64)
    assert args.kv_space_gib == 1
    assert (args.concurrency, args.gbits) == ([1, 4, 8], [0.1, 0.4])
    assert vllm_bench.parse_args(["--new", "8", "--gbits", "0.2"]).new == 8  # a flag given wins
    long = workload.WorkloadSpec("long", "long documents", 2, 7000, 1, 256, (1, 8, 16), (0.4,), 4, texts=dict)
    monkeypatch.setitem(workload.WORKLOADS, "long", long)
    args = vllm_bench.parse_args(["--workload", "long"])
    assert (args.documents, args.doc_tokens, args.new, args.kv_space_gib, args.concurrency, args.gbits) == (
        2,
        7000,
        256,
        4,
        [1, 8, 16],
        [0.4],
    )
    assert vllm_bench.parse_args(["--workload", "long", "--gbits", "0", "0.1"]).gbits == [0.0, 0.1]  # 0: beside


def test_the_connectors_load_lines_are_kept_without_vllms_prefix():
    log = "\n".join(
        [
            "(EngineCore pid=31097) INFO 12-06 22:24:00 [scheduler.py:176] VeriCache load-or-recompute: cmpl-1: "
            "recompute 0 of 1792 stored tokens (est. 2.64s; all 6.67s, none 2.64s)",
            "(APIServer pid=1) INFO 12-06 22:24:01 [loggers.py:335] Engine 000: Avg prompt throughput: 5.7 tokens/s",
            "(Worker pid=31110) INFO 12-06 22:23:59 [worker.py:225] hit cmpl-0: 1792 tokens loaded (full after 6.57s)",
            "WARNING load of req-5 failed (TimeoutError: x): vLLM recomputes its 7 blocks",
        ]
    )
    assert server_logs.excerpt(log) == [
        "22:24:00 VeriCache load-or-recompute: cmpl-1: recompute 0 of 1792 stored tokens (est. 2.64s; all 6.67s, "
        "none 2.64s)",
        "22:23:59 hit cmpl-0: 1792 tokens loaded (full after 6.57s)",
        "WARNING load of req-5 failed (TimeoutError: x): vLLM recomputes its 7 blocks",
    ]


def test_every_router_topology_configuration_gets_the_same_cores(tmp_path, monkeypatch):
    """Issue 53: the router and its alternatives on EQUAL compute. Each configuration's launch (the real code,
    with stand-in processes for vLLM and the front process) starts N + 1 servers, one beside the store and N
    across the link, and its front process; the cores each got are read back from the processes' affinity: the
    same for every configuration, the server beside the store alone on its core."""
    import argparse
    import os
    import subprocess
    from contextlib import ExitStack

    from benchmarks.kit import vllm_server
    from benchmarks.vllm_load import router as topo
    from vericache_connector.demo import procs

    if not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("pinning needs 2 cores")
    got: dict[str, dict[str, frozenset[int]]] = {}  # configuration -> {process: its cores}
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]

    class Server:  # VLLMServer's part launch() uses: started under procs.affinity, as vLLM's server is
        def __init__(self, cfg, log_path: str):
            self.cfg, self.name, self.url = cfg, log_path.rsplit("-", 1)[1][:-4], "http://127.0.0.1:1"

        def __enter__(self):
            self.proc = subprocess.Popen(sleeper)
            got[current][self.name] = frozenset(os.sched_getaffinity(self.proc.pid))
            return self

        def __exit__(self, *exc):
            self.proc.kill()
            self.proc.wait()

        def complete(self, *args, **kwargs):
            return None

    class Front(procs.Proc):
        def __init__(self, name, argv, log_path, env, cores=None, program=None):
            super().__init__(name, [], log_path, env, cores, program=sleeper)
            got[current]["front"] = frozenset(os.sched_getaffinity(self.proc.pid))

        def wait_ready(self, timeout_s: float = 600) -> str:
            return "http://127.0.0.1:1"

        def stop(self) -> None:
            self.kill()

    monkeypatch.setattr(vllm_server, "VLLMServer", Server)
    monkeypatch.setattr(procs, "Proc", Front)
    monkeypatch.setattr(topo, "wait_models", lambda url: None)
    args = argparse.Namespace(
        drafters=2, compressor="kivi4", kv_space_gib=1, verifier_decode_slots=0, max_verifier_decode_slots=None
    )
    args.scale_to = "none"
    for config in topo.TOPOLOGY:
        current = config.slug
        got[current] = {}
        ctx = configs.Context(args, "model", 2048, gbits=0.2, store_url="local://x", log_dir=tmp_path, name=current)
        with ExitStack() as stack:
            config.launch(stack, ctx)
    usable = procs.usable_cores()
    for slug, seen in got.items():
        beside = [seen[n] for n in seen if n in topo.BESIDE]
        across = {seen[n] for n in seen if n not in topo.BESIDE}
        assert len(seen) == 2 + 2 and len(beside) == 1, (slug, seen)  # N + 1 servers and the front process
        assert beside == [frozenset(usable[-1:])] and across == {frozenset(usable[:-1])}, (slug, seen)
    assert summary.served_paths({"verified": 5, "direct": 2, "fallback": 1}, 10) == {
        "drafted": 5, "direct": 4, "handed_back": 1, "alone": 0}  # fmt: skip
