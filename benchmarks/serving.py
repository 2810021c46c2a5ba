"""Long-context serving under a device KV budget: full KV, lossy and VeriCache on the same trace, side by side.

One process, one model (SmolLM2-135M float32 on the CPU), one trace of long real prompts (bundled texts,
4k-7k tokens) served three ways by vericache_connector.engine.serving.ServingEngine:
  full       full KV resident; admission limited by full bytes (what a server does today)
  lossy      compressed KV only (fast, inexact: shown for reference)
  vericache  compressed KV resident, full KV in the host tier, reloaded over the host link for each
             verification (staggered), output identical to full KV
(a) vs request rate: Poisson arrivals at each rate, at one budget; (b) vs budget fraction: all requests at
t=0, the budget a fraction of the trace's full-KV demand (sum over requests of (prompt + new tokens) x full
KV bytes per token). Every row checks every request's output against its own single-request full-KV greedy
output and says so.

CPU PROXY of the GPU memory hierarchy: the device budget is a byte cap on the resident caches (block manager),
the host link an EMULATED rate (real copies on a copy thread, paced to --link-gbps); the compute is real.
Each prompt's forward is computed once (its time is reported) and replayed in every run: prefill compute is
the same for every policy, and replaying it keeps a many-run benchmark within the machine's time; a run's
throughput is its output tokens over its wall time (prefill replay, compression and host offload included).

    python benchmarks/serving.py                                   # the default grid (~1 h on 2 cores)
    python benchmarks/serving.py --requests 4 --budgets 0.25 --rates --new 32 --json   # a quick look
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

import bench_paths


def parse_args(argv=None):
    bench_paths.setup()
    from vericache_connector.engine.config import POLICIES

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=8, help="requests in the trace")
    p.add_argument("--min-tokens", type=int, default=4096, help="shortest prompt")
    p.add_argument("--max-tokens", type=int, default=7168, help="longest prompt")
    p.add_argument("--new", type=int, default=128, help="new tokens per request")
    p.add_argument(
        "--budgets",
        type=float,
        nargs="*",
        default=[0.2, 0.25, 0.35, 0.5, 0.75],
        help="(b) budget fractions of the trace's full-KV demand",
    )
    p.add_argument(
        "--rates",
        type=float,
        nargs="*",
        default=[0.05, 0.2],
        help="(a) Poisson arrival rates, requests/s (at --rate-budget)",
    )
    p.add_argument("--rate-budget", type=float, default=0.25)
    p.add_argument(
        "--links",
        type=float,
        nargs="*",
        default=[0.08],
        help="(c) VeriCache at --rate-budget with these host links too, GB/s (0.08: the H200's HBM:PCIe "
        "ratio on this CPU; --link-gbps 0.5: GH200's C2C ratio; see the README)",
    )
    p.add_argument("--link-gbps", type=float, default=0.5, help="emulated host link, GB/s")
    p.add_argument("--compressor", default="snapkv-4x")
    p.add_argument("--k-max", type=int, default=64)
    p.add_argument("--alpha", type=float, default=0.8, help="prior per-draft acceptance (measured curve)")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None)
    p.add_argument("--out", default="results/serving")
    p.add_argument("--json", action="store_true", help="print results.json on stdout")
    args = p.parse_args(argv)
    if not 0 < args.min_tokens <= args.max_tokens:
        p.error(f"need 0 < --min-tokens <= --max-tokens, got {args.min_tokens}, {args.max_tokens}")
    if any(not 0 < b <= 1 for b in args.budgets + [args.rate_budget]):
        p.error("budget fractions must be in (0, 1]")
    if any(r <= 0 for r in args.rates):
        p.error("arrival rates must be > 0")
    return args


def make_prompts(engine, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """n real prompts of lo..hi tokens: slices of the bundled texts laid end to end, each from its own offset."""
    from vericache_connector.data import load_prompts

    stream = [t for text in load_prompts().values() for t in engine.encode(text)]
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        length = rnd.randint(lo, hi)
        start = (i * len(stream) // n) % max(1, len(stream) - length)
        out.append((stream + stream)[start : start + length])
    return out


def reference_cache(model: str | None, dtype) -> Path:
    from storage_backends.identity import model_fingerprint
    from vericache_connector.model import resolve_model_dir
    from vericache_connector.model.loader import cache_root

    d = cache_root() / "bench-references" / model_fingerprint(resolve_model_dir(model), str(dtype))
    d.mkdir(parents=True, exist_ok=True)
    return d


def trace(prompts, new: int, rate: float | None, seed: int):
    from vericache_connector.engine.sequence import Request

    rnd, t, out = random.Random(seed), 0.0, []
    for i, p in enumerate(prompts):
        if rate is not None and i > 0:
            t += rnd.expovariate(rate)
        out.append(Request(f"r{i}", p, new, arrival_s=t if rate is not None else 0.0, seed=seed + i))
    return out


def run_one(model, policy, budget, args, reqs, refs, store, label, link_gbps=None):
    from vericache_connector.engine.config import ServingConfig
    from vericache_connector.engine.serving import ServingEngine

    cfg = ServingConfig(
        policy=policy,
        budget_bytes=budget,
        compressor=args.compressor,
        k_max=args.k_max,
        link_bytes_per_s=(link_gbps or args.link_gbps) * 1e9,
        alpha_prior=args.alpha,
    )
    import os

    total = sum(r.max_new_tokens for r in reqs)
    load0 = os.getloadavg()[0]
    with tqdm(total=total, desc=label, unit="tok", leave=False) as bar:
        rep = ServingEngine(model, cfg, store).run(reqs, on_tokens=bar.update)
    load = (load0 + os.getloadavg()[0]) / 2  # other work on the machine during the run (same-run ratios)
    outs = rep.outputs()
    same = sum(outs[r.request_id] == refs[r.request_id] for r in reqs)
    row = {k: v for k, v in rep.summary().items() if k != "split"}
    row.update({f"{k}": v for k, v in vars(rep.split).items()})
    row.update(
        policy=policy,
        identical_n=same,
        requests=len(reqs),
        link_gbps=link_gbps or args.link_gbps,
        load_avg=load,
        accepted_per_request={r.request_id: r.accepted for r in rep.requests} if policy == "vericache" else {},
        identical=same == len(reqs),
        max_concurrent=max_concurrency(rep),
    )
    return row


def max_concurrency(rep) -> int:
    """Most requests admitted and not finished at any one time."""
    ev = sorted([(r.admitted_s, 1) for r in rep.requests] + [(r.finished_s, -1) for r in rep.requests])
    cur = best = 0
    for _, d in ev:
        cur += d
        best = max(best, cur)
    return best


def main(argv=None) -> int:
    args = parse_args(argv)
    bench_paths.setup()
    import torch

    from vericache_connector.engine import DecodeConfig, VeriCacheEngine

    torch.set_num_threads(args.threads)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) / stamp
    out.mkdir(parents=True, exist_ok=True)
    cmd = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    (out / "command.txt").write_text(cmd + "\n")
    engine = VeriCacheEngine.from_pretrained(args.model)
    model = engine.model
    prompts = make_prompts(engine, args.requests, args.min_tokens, args.max_tokens, args.seed)
    per_token = model.cfg.kv_bytes_per_token(model.dtype.itemsize)
    demand = sum((len(p) + args.new) * per_token for p in prompts)
    # each prompt's forward once (timed), kept for the runs to replay; the references (each request alone,
    # plain full-KV greedy) are kept on disk by model fingerprint and prompt, so later runs reuse them
    from vericache_connector.compressors import PrefixKV
    from vericache_connector.engine.llm_engine import Prefill
    from vericache_connector.engine.serving import ServingEngine

    store: dict = {}
    refs, prefill_s = {}, []
    cache = reference_cache(args.model, model.dtype)
    for i, p in enumerate(tqdm(prompts, desc="prefills + references", leave=False)):
        t = time.perf_counter()
        ServingEngine.precompute_prefills(model, [p], engine.obs_window, store)
        prefill_s.append(time.perf_counter() - t)
        key = cache / (hashlib.blake2b(json.dumps([p, args.new]).encode(), digest_size=12).hexdigest() + ".json")
        if key.is_file():
            refs[f"r{i}"] = json.loads(key.read_text())["output"]
            continue
        logits, layers = store[(tuple(p), engine.obs_window)]
        pre = Prefill(p, PrefixKV([k for k, _, _ in layers], [v for _, v, _ in layers]), logits)
        refs[f"r{i}"] = engine.generate_full([pre], DecodeConfig(max_new_tokens=args.new, stop_at_eos=False))[0]
        key.write_text(json.dumps({"output": refs[f"r{i}"]}))
    # warm-up: every policy once on a short trace (imports, kernel plans, the prefill store)
    warm = trace([p[:600] for p in prompts[:2]], 4, None, args.seed)
    for policy in args.policies:
        run_one(model, policy, None, args, warm, {r.request_id: [] for r in warm}, {}, f"warm-up {policy}")
    rows = []
    grid = (
        [("budget", b, None, None) for b in args.budgets]
        + [("rate", args.rate_budget, r, None) for r in args.rates]
        + [("link", args.rate_budget, None, g) for g in args.links]
    )
    context = dict(demand=demand, prompts=prompts, prefill_s=prefill_s, cmd=cmd, threads=torch.get_num_threads())
    for kind, frac, rate, link in grid:
        reqs = trace(prompts, args.new, rate, args.seed)
        for policy in args.policies:
            if kind == "link" and policy != "vericache":  # only VeriCache uses the link: its baseline is the budget row
                continue
            label = f"{kind} {frac:g}{'' if rate is None else f' @ {rate:g}/s'}{'' if link is None else f' {link:g} GB/s'} {policy}"
            row = run_one(model, policy, int(frac * demand), args, reqs, refs, store, label, link)
            row.update(sweep=kind, budget_fraction=frac, rate=rate)
            rows.append(row)
            print(fmt_row(row), file=sys.stderr)
            write(out, rows, args, context, complete=False)  # after every row: a crash keeps what was measured
    doc = write(out, rows, args, context, complete=True)
    plot(rows, out, args)
    print(table(rows, args, demand, prefill_s, cmd))
    if args.json:
        print(json.dumps(doc, indent=2))
    print(f"results in {out}", file=sys.stderr)
    return 0 if all(r["identical"] for r in rows if r["policy"] != "lossy") else 1


def write(out: Path, rows: list[dict], args, ctx: dict, complete: bool) -> dict:
    """results.json and table.md of the rows so far; ratio_vs_full against the full-KV run of the same trace and
    budget (link rows: the budget sweep's)."""
    for row in rows:
        sweep = "budget" if row["sweep"] == "link" else row["sweep"]
        base = next(
            (
                r
                for r in rows
                if r["sweep"] == sweep
                and r["budget_fraction"] == row["budget_fraction"]
                and r["rate"] == row["rate"]
                and r["policy"] == "full"
            ),
            None,
        )
        row["ratio_vs_full"] = None if base is None else row["tokens_per_s"] / base["tokens_per_s"]
    summary = [
        {
            "budget_fraction": r["budget_fraction"],
            "policy": r["policy"],
            "tokens_per_s": r["tokens_per_s"],
            "ratio_vs_full": r["ratio_vs_full"],
            "identical": r["identical"],
            "requests": r["requests"],
        }
        for r in rows
        if r["sweep"] == "budget"
    ]
    doc = {
        "summary": summary,
        "complete": complete,
        "rows": rows,
        "demand_bytes": ctx["demand"],
        "prompt_tokens": [len(p) for p in ctx["prompts"]],
        "prefill_s": ctx["prefill_s"],
        "mean_prefill_s": statistics.fmean(ctx["prefill_s"]),
        "args": vars(args),
        "threads": ctx["threads"],
        "command": ctx["cmd"],
        "proxy": "CPU: device budget = byte cap on resident caches; host link emulated at "
        f"{args.link_gbps} GB/s (real copies, paced); compute real; prefills computed once, replayed",
    }
    (out / "results.json").write_text(json.dumps(doc, indent=2))
    (out / "table.md").write_text(table(rows, args, ctx["demand"], ctx["prefill_s"], ctx["cmd"]))
    return doc


def fmt_row(r) -> str:
    return (
        f"{r['sweep']} {r['budget_fraction']:g} rate {r['rate']} {r['policy']}: {r['tokens_per_s']:.2f} tok/s, "
        f"identical {r['identical_n']}/{r['requests']}, concurrent {r['max_concurrent']}, "
        f"accepted/verify {r['mean_accepted']:.2f}, link {r['link_utilization']:.0%}"
    )


def table(rows, args, demand, prefill_s, cmd) -> str:
    lines = [
        f"`{cmd}`",
        "",
        f"CPU proxy: device budget = byte cap on resident caches; host link EMULATED at {args.link_gbps} GB/s; compute "
        f"real (SmolLM2-135M float32). Trace: {args.requests} prompts of {args.min_tokens}-{args.max_tokens} tokens, "
        f"{args.new} new tokens each; full-KV demand {demand / 2**20:.0f} MiB; each prompt's forward computed once "
        f"(mean {statistics.fmean(prefill_s):.1f} s) and replayed in every run. Compressor {args.compressor}, "
        f"k_max {args.k_max}.",
        "",
        "| sweep | budget | rate /s | link GB/s | policy | tok/s | x full | identical | concurrent | mean lat s | p90 lat s | "
        "TTFT s | acc/verify | link util | peak MiB | draft s | verify s | decode s | link wait s | idle s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = "-" if r["ratio_vs_full"] is None else f"{r['ratio_vs_full']:.2f}"
        lines.append(
            f"| {r['sweep']} | {r['budget_fraction']:g} | {'-' if r['rate'] is None else r['rate']} | "
            f"{r['link_gbps'] if r['policy'] == 'vericache' else '-'} | {r['policy']} | "
            f"{r['tokens_per_s']:.2f} | {ratio} | {'yes' if r['identical'] else 'NO'} {r['identical_n']}/{r['requests']} | "
            f"{r['max_concurrent']} | {r['mean_latency_s']:.1f} | {r['p90_latency_s']:.1f} | {r['mean_ttft_s']:.1f} | "
            f"{r['mean_accepted']:.2f} | {r['link_utilization']:.0%} | {r['peak_resident_bytes'] / 2**20:.0f} | "
            f"{r['draft_step_s']:.1f} | {r['verify_step_s']:.1f} | {r['decode_step_s']:.1f} | {r['link_wait_s']:.1f} | "
            f"{r['idle_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows, out: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for sweep, xkey, xlabel in (
        ("budget", "budget_fraction", "device KV budget (fraction of the trace's full-KV demand)"),
        ("rate", "rate", "arrival rate (requests/s)"),
    ):
        sel = [r for r in rows if r["sweep"] == sweep]
        if not sel:
            continue
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for policy in args.policies:
            pts = sorted((r[xkey], r) for r in sel if r["policy"] == policy)
            xs = [x for x, _ in pts]
            axes[0].plot(xs, [r["tokens_per_s"] for _, r in pts], marker="o", label=policy)
            axes[1].plot(xs, [r["mean_latency_s"] for _, r in pts], marker="o", label=policy)
        axes[0].set_ylabel("output tokens/s")
        axes[1].set_ylabel("mean latency (s)")
        for ax in axes:
            ax.set_xlabel(xlabel)
            ax.grid(alpha=0.3)
            ax.legend()
        fig.suptitle(f"serving on the CPU proxy (link {args.link_gbps} GB/s emulated, {args.compressor})")
        fig.tight_layout()
        fig.savefig(out / f"{sweep}.png", dpi=120)
        plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
