"""A vllm_bench.py run: the workload, the store writer, one fresh server set and one client run per planned run,
the summary; or the dry run (every command line, nothing started).

Layout of the results folder (kit.results): results.json, table.md, command.txt, throughput.png, and logs/
(kept out of git): dataset.jsonl (the client's input; rebuilt byte for byte from results.json's arguments),
every server's log, and clients/ (each client's raw JSON and output).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from benchmarks.kit import load as kit_load
from benchmarks.kit.results import Results
from benchmarks.vllm_load.client import check_client_flags, client_command, client_metrics
from benchmarks.vllm_load.configs import Context, link_scale, openmp_env, writer_config
from benchmarks.vllm_load.grid import BY_NAME, REFERENCE, Run, plan_runs
from benchmarks.vllm_load.logs import accepted_by_source, excerpt, log_stats, read_logs, scrape, wait_saves
from benchmarks.vllm_load.report import link_name, plot, table
from benchmarks.vllm_load.summary import EMULATED, summarize
from benchmarks.vllm_load.workload import (
    WORKLOADS,
    Workload,
    build_workload,
    describe,
    kv_bytes_per_token,
    write_dataset,
)


def main(args, argv=None) -> int:
    from transformers import AutoTokenizer

    from vericache_connector.model.loader import resolve_model_dir
    from vericache_connector.store.config import RemoteCacheConfig

    model = str(resolve_model_dir(args.model))
    tok = AutoTokenizer.from_pretrained(model)
    chunk = RemoteCacheConfig().chunk_size
    work = build_workload(
        args,
        WORKLOADS[args.workload].texts(),
        lambda t: tok(t).input_ids,  # as vLLM's server tokenizes a text prompt
        lambda ids: tok.decode(ids),
        chunk,
    )
    for w in work.warnings:
        print(f"WARNING: {w}", flush=True)
    if REFERENCE[args.topology] not in args.configs:
        print(f"WARNING: {REFERENCE[args.topology]} is not run: no reference for 'identical' (null)", flush=True)
    max_len = max(r["tokens"] for r in work.requests) + args.new + max(args.spec_k, args.ngram_k) + 64
    workload = describe(args, work, chunk, kv_bytes_per_token(model), link_scale(args))
    runs = plan_runs(args)
    needs_store = any(BY_NAME[c].reads_store for c in args.configs)
    workload["server_env"] = openmp_env(args.openmp)
    os.environ.update(workload["server_env"])  # every server (and client) this run starts inherits it
    if args.dry_run:
        return dry_run(args, model, max_len, work, workload, runs, needs_store)

    out = Results.create(args.out, argv)
    (out.logs / "clients").mkdir()
    dataset = out.logs / "dataset.jsonl"
    workload["dataset"] = {"path": str(dataset.relative_to(out.path)), "sha1": write_dataset(work, dataset, args.new)}
    store_root = Path(tempfile.mkdtemp(prefix="vericache-vllm-bench-"))
    print(EMULATED, flush=True)
    if workload["link_s"]:
        print(
            f"full copy of a document's {work.documents[0]['stored']} stored tokens: "
            f"{workload['full_copy_bytes'] / 1e6:.1f} MB; at the "
            + ", ".join(f"{g} Gbit/s link {s:.2f} s" for g, s in workload["link_s"].items()),
            flush=True,
        )
    load = kit_load.LoadAverage().start()
    results = []
    from tqdm.auto import tqdm

    try:
        with tqdm(total=len(runs) + needs_store, desc="vllm bench", unit="server") as bar:
            if needs_store:
                write_store(args, model, max_len, work, store_root / "written", out.logs)
                bar.update(1)
            for run in runs:
                results.append(execute(args, model, max_len, run, dataset, len(work.requests), store_root, out))
                bar.write(f"{run.name}: {progress(results[-1])}")
                bar.update(1)
    finally:
        shutil.rmtree(store_root, ignore_errors=True)
    result = summarize(args, results, workload, load.stop(), out.command)
    out.write(result, table(result), indent=1)
    plot(result["summary"], out / "throughput.png")
    print(table(result) + f"\n\nresults: {out}")
    ok = all(s["identical"] is not False and not s["errors"] for s in result["summary"])
    return 0 if ok else 1


def progress(row: dict) -> str:
    """One line per run while the sweep goes on."""
    if not row.get("client"):
        return f"FAILED: {row.get('error')}"
    m = client_metrics(row["client"])
    return (
        f"{m['output_throughput']:.1f} tok/s, TTFT {m['mean_ttft_s']:.2f} s mean / {m['p90_ttft_s']:.2f} s p90, "
        f"TPOT {m['mean_tpot_ms']:.1f} ms, E2E {m['mean_e2e_s']:.2f} s, hits {row['logs']['hits']}, "
        f"load avg {row['load_avg']:.2f}"
    )


def write_store(args, model: str, max_len: int, work: Workload, store_dir: Path, log_dir: Path) -> None:
    """A connector server with no link limit serves each document's first question once; its saves logged,
    it stops. The store directory is what every measured connector server copies."""
    from benchmarks.kit.vllm_server import VLLMServer, post_json

    store_dir.mkdir(parents=True)
    ctx = Context(args, model, max_len, store_url=f"local://{store_dir}", log_dir=log_dir, name="store-writer")
    log = ctx.log_path("vllm")
    firsts = {}
    for r in work.requests:
        if r["question"] == 0:
            firsts[r["document"]] = r["prompt"]
    with VLLMServer(writer_config(ctx), log_path=str(log)) as srv:
        for prompt in firsts.values():
            status, body = post_json(
                srv.url + "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
            )
            if status != 200:
                raise RuntimeError(f"store writer: HTTP {status}: {body}")
        if work.documents[0]["stored"]:
            wait_saves(log, len(firsts))
    if not any(store_dir.iterdir()):
        raise RuntimeError(f"the store writer wrote nothing to {store_dir}")


def execute(args, model, max_len, run: Run, dataset: Path, requests: int, store_root: Path, out: Results) -> dict:
    """One run: a copy of the written store (hard links: a rewrite replaces a file, the written store keeps
    its own), fresh servers, the client; the row's raw material (paths relative to the results folder)."""
    row = {"round": run.round, "concurrency": run.concurrency, "gbits": run.gbits, "configuration": run.config.label}
    result = out.logs / "clients" / f"{run.name}.json"
    client_log = out.logs / "clients" / f"{run.name}.log"
    copy = store_root / run.name
    ctx = Context(args, model, max_len, gbits=run.gbits, log_dir=out.logs, name=run.name)
    if run.config.reads_store:
        shutil.copytree(store_root / "written", copy, copy_function=os.link)
        ctx.store_url = f"local://{copy}"
    env = {**os.environ, "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    try:
        with ExitStack() as stack:
            base = run.config.launch(stack, ctx)
            cmd = client_command(args, model, base, dataset, requests, run.concurrency, result)
            row["load_avg"] = kit_load.now()
            with open(client_log, "w") as f:
                t0 = time.perf_counter()
                proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=args.client_timeout)
                row["client_wall_s"] = time.perf_counter() - t0
            if proc.returncode != 0:
                tail = client_log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the client exited with {proc.returncode}: {tail}")
            row["accepted_by_source"] = accepted_by_source(scrape(base))  # before the servers stop
        row["client"] = json.loads(result.read_text())
        row["client_json"] = str(result.relative_to(out.path))
    except Exception as e:  # noqa: BLE001 - the row records it; the sweep goes on
        row["error"] = f"{type(e).__name__}: {e}"[:4000]
        row["load_avg"] = row.get("load_avg")
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    text = read_logs(ctx.logs)
    row["logs"] = log_stats(text)
    row["log_excerpt"] = excerpt(text)
    row["server_logs"] = [str(p.relative_to(out.path)) for p in ctx.logs]
    row["client_log"] = str(client_log.relative_to(out.path))
    return row


def dry_run(args, model, max_len, work: Workload, workload: dict, runs: list[Run], needs_store: bool) -> int:
    """The dataset, every server's command line and every client command line; nothing is started."""
    tmp = Path(tempfile.gettempdir()) / "vericache-vllm-bench-dry-run"  # the dataset, overwritten by each dry run
    tmp.mkdir(exist_ok=True)
    dataset = tmp / "dataset.jsonl"
    write_dataset(work, dataset, args.new)
    print(f"dry run: nothing is started. {EMULATED}.")
    print(f"server environment: {workload['server_env'] or 'as is'} (--openmp {args.openmp})")
    print(
        f"workload {args.workload}: {len(work.documents)} documents x {args.questions} questions = "
        f"{len(work.requests)} requests, {args.doc_tokens} tokens per document ({work.documents[0]['stored']} of "
        f"them stored, shared by its questions), {args.new} new tokens; dataset: {dataset}"
    )
    print("order: " + ", ".join(f"{d}#{q}" for d, q in workload["order"]))
    if workload["link_s"]:
        print(
            "full-copy link time per document: "
            + ", ".join(f"{g} Gbit/s {s:.2f} s" for g, s in workload["link_s"].items())
        )
    port = "<port>"
    if needs_store:
        ctx = Context(args, model, max_len, store_url="local://<store>/written", name="store-writer")
        print("\nstore writer (each document's first question, then its saves):")
        print("  " + shlex.join(writer_config(ctx).command(0)).replace("--port 0", f"--port {port}"))
    checked = None
    for run in runs:
        ctx = Context(args, model, max_len, gbits=run.gbits, store_url=f"local://<store>/{run.name}", name=run.name)
        print(f"\n{run.name} ({run.config.label}, {link_name(run.gbits)}, concurrency {run.concurrency}):")
        servers = run.config.servers(ctx)
        for name, cfg in servers.items():
            print(f"  server {name}: " + shlex.join(cfg.command(0)).replace("--port 0", f"--port {port}"))
        if hasattr(run.config, "router_argv"):  # --topology router: `vericache router` in front of them
            urls = {name: f"http://127.0.0.1:<{name} port>" for name in servers}
            print("  vericache " + shlex.join(run.config.router_argv(ctx, urls)).replace("--port 0", f"--port {port}"))
        url = f"http://127.0.0.1:{port}"
        cmd = client_command(args, model, url, dataset, len(work.requests), run.concurrency, tmp / f"{run.name}.json")
        print("  client: " + shlex.join([*cmd[:2], "<run vllm.benchmarks.serve>", *cmd[3:]]))
        if not checked:
            try:
                check_client_flags(cmd)
            except SystemExit as e:
                print(f"vllm.benchmarks.serve refuses the client's flags (exit {e.code})")
                return 2
            except ImportError as e:
                checked = f"vLLM is not importable: the client's flags are not checked ({e})"
            else:
                checked = "the client's flags parse with vllm.benchmarks.serve's own parser"
    print(f"\n{len(runs) + needs_store} server runs; {checked or 'no client runs'}")
    return 0
