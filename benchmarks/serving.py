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
import os
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

import bench_paths

EMULATED = (
    "CPU proxy: the device KV budget is a byte cap on the resident caches and the host link is EMULATED on the CPU "
    "(real copies on a copy thread, paced to {link} GB/s; link rows {links}); the compute is real"
)


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
    p.add_argument(
        "--kinds",
        nargs="*",
        default=None,
        help="instead of the grid: accepted drafts per verification (A) per prompt kind, VeriCache with and "
        "without the n-gram draft source (--ngram), on these bundled prompts (none given: a code continuation "
        "and the six chat prompts), each compressor of --compressor / --kinds-compressors",
    )
    p.add_argument("--kinds-compressors", nargs="+", default=None, help="compressors of --kinds (default --compressor)")
    p.add_argument("--ngram", type=int, default=8, help="--kinds: n-gram tokens proposed per draft step")
    p.add_argument("--draft-dtype", default="float16", help="the draft pool's dtype (float32: complement reloads)")
    p.add_argument(
        "--fallback",
        nargs="?",
        const="on",
        choices=["on", "both"],
        default=None,
        help="VeriCache runs ask the capacity model (engine/capacity.py, with this CPU's figures calibrated from "
        "the budget's full-KV run and --alpha as the acceptance) and serve full KV where it predicts a loss; "
        "'both': each VeriCache row runs without the model, then with it, given the acceptance that row measured "
        "(its prediction and what it served)",
    )
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


def run_one(
    model, policy, budget, args, reqs, refs, store, label, link_gbps=None, hardware=None, prefill_s=0.0, alpha=None
):
    from vericache_connector.engine.config import ServingConfig
    from vericache_connector.engine.serving import ServingEngine

    cfg = ServingConfig(
        hardware=hardware,
        prefill_s=prefill_s,
        policy=policy,
        budget_bytes=budget,
        compressor=args.compressor,
        k_max=args.k_max,
        link_bytes_per_s=(link_gbps or args.link_gbps) * 1e9,
        alpha_prior=args.alpha if alpha is None else alpha,
        draft_dtype=args.draft_dtype,
    )
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
        served_policy=rep.served_policy,
        predicted_speedup=None if rep.prediction is None else rep.prediction["speedup"],
        prediction=rep.prediction,
        hardware=None if hardware is None else vars(hardware),
        identical=same == len(reqs),
    )
    return row


def cpu_flops(model) -> float:
    """The CPU's FLOP/s on this model: a 256-token forward, timed (the capacity model's compute roofline)."""
    import torch

    from vericache_connector.engine.model_runner import ModelRunner

    ids = list(range(1, 257))
    runner = ModelRunner(model, {})
    runner.prefill(ids, 0, lambda *a: None)
    t = time.perf_counter()
    runner.prefill(ids, 0, lambda *a: None)
    params = sum(p.numel() for p in model.parameters())
    return 2 * params * len(ids) / (time.perf_counter() - t) if torch.get_num_threads() else 1e12


def cpu_hardware(full_row: dict, model, prompts, link_bytes_per_s: float, flops: float, rates: tuple[float, float]):
    """engine.capacity.Hardware of this CPU: memory bandwidth from a full-KV run's decode steps (weights + its rows'
    KV read per step), FLOP/s timed, the attention kernels' rates timed (engine/calibrate.py), the emulated link
    (the budget is the run's: mem_bytes unused)."""
    from vericache_connector.engine.capacity import Hardware

    steps = max(1, full_row["steps"])
    ctx = statistics.fmean(len(p) for p in prompts)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    kv = model.cfg.kv_bytes_per_token(model.dtype.itemsize)
    rows = max(1, full_row["max_concurrent"])
    bw = (weights + rows * ctx * kv) / (full_row["decode_step_s"] / steps)
    return Hardware(
        "CPU (calibrated)", bw, flops, 0.0, link_bytes_per_s, attn_flops=rates[0], draft_attn_flops=rates[1]
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    bench_paths.setup()
    import torch

    if args.kinds is not None:
        return kinds_main(args, argv)

    from vericache_connector.engine import DecodeConfig, VeriCacheEngine

    torch.set_num_threads(args.threads)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) / stamp
    out.mkdir(parents=True, exist_ok=True)
    cmd = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    (out / "command.txt").write_text(cmd + "\n")
    print(EMULATED.format(link=args.link_gbps, links=args.links), file=sys.stderr)
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
    flops = cpu_flops(model) if args.fallback else None
    rates, pre_s = None, 0.0
    if args.fallback:  # the attention kernels as the VeriCache rows run them, timed at the trace's mean prompt
        from vericache_connector.engine.calibrate import attention_rates, prefill_seconds
        from vericache_connector.engine.config import ServingConfig

        probe = ServingEngine(model, ServingConfig(compressor=args.compressor, draft_dtype=args.draft_dtype))
        ctx_mean = int(statistics.fmean(len(p) for p in prompts))
        rates, pre_s = attention_rates(probe, context=ctx_mean), prefill_seconds(probe, context=ctx_mean)
        print(
            f"attention on this CPU: dense {rates[0] / 1e9:.1f}, draft {rates[1] / 1e9:.1f} GFLOP/s; a VeriCache "
            f"prefill adds {pre_s:.2f} s",
            file=sys.stderr,
        )
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
            modes = [False]
            if policy == "vericache" and args.fallback:
                modes = [False, True] if args.fallback == "both" else [True]
            for planned in modes:
                hw, alpha = None, args.alpha
                if planned:  # the CPU's figures from this budget's full-KV run
                    base = next((r for r in rows if r["policy"] == "full" and r["budget_fraction"] == frac), None)
                    hw = (
                        None
                        if base is None
                        else cpu_hardware(base, model, prompts, (link or args.link_gbps) * 1e9, flops, rates)
                    )
                    if len(modes) == 2 and rows[-1].get("alpha"):  # the acceptance the row just run measured
                        alpha = min(0.999, rows[-1]["alpha"])
                row = run_one(
                    model,
                    policy,
                    int(frac * demand),
                    args,
                    reqs,
                    refs,
                    store,
                    label,
                    link,
                    hw,
                    pre_s if hw else 0.0,
                    alpha,
                )
                row.update(
                    sweep=kind,
                    budget_fraction=frac,
                    rate=rate,
                    capacity_model=hw is not None,
                    capacity_alpha=alpha if hw is not None else None,
                )
                rows.append(row)
                print(fmt_row(row), file=sys.stderr)
                write(out, rows, args, context, complete=False)  # after every row: a crash keeps what was measured
    doc = write(out, rows, args, context, complete=True)
    plot(rows, out, args)
    print(table(rows, args, demand, prefill_s, cmd))
    if args.json:
        print(json.dumps(doc, indent=2))
    print(EMULATED.format(link=args.link_gbps, links=args.links), file=sys.stderr)
    print(f"results in {out}", file=sys.stderr)
    return 0 if all(r["identical"] for r in rows if r["policy"] != "lossy") else 1


KINDS = ["graphlib_py"] + [
    "chat_code_textwrap",
    "chat_customization_qa",
    "chat_debugger_multiturn",
    "chat_formatstrings_qa",
    "chat_json_extract_shlex",
    "chat_tool_call_inventory",
]


def kinds_main(args, argv) -> int:
    """A (accepted drafts per verification) per prompt kind, with and without the n-gram draft source: each
    prompt alone (no budget), VeriCache over the emulated link, outputs checked against full-KV greedy."""
    import torch

    from vericache_connector.data.chat_prompts import chat_prompt_names, load_any_prompt, load_chat_prompt
    from vericache_connector.engine import DecodeConfig, VeriCacheEngine
    from vericache_connector.engine.config import ServingConfig
    from vericache_connector.engine.sequence import Request
    from vericache_connector.engine.serving import ServingEngine

    torch.set_num_threads(args.threads)
    names = args.kinds or KINDS
    out = Path(args.out) / (time.strftime("%Y%m%d-%H%M%S") + "-kinds")
    out.mkdir(parents=True, exist_ok=True)
    cmd = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    print(EMULATED.format(link=args.link_gbps, links=[]), file=sys.stderr)
    engine = VeriCacheEngine.from_pretrained(args.model)
    model, store, rows = engine.model, {}, []
    cache = reference_cache(args.model, model.dtype)
    for name in names:
        kind = load_chat_prompt(name)["kind"] if name in chat_prompt_names() else "plain text: " + name
        ids = engine.encode(load_any_prompt(name, engine.tokenizer))
        key = cache / (hashlib.blake2b(json.dumps([ids, args.new]).encode(), digest_size=12).hexdigest() + ".json")
        ServingEngine.precompute_prefills(model, [ids], engine.obs_window, store)
        if key.is_file():
            ref = json.loads(key.read_text())["output"]
        else:
            ref = engine.generate_full([engine.prefill(ids)], DecodeConfig(max_new_tokens=args.new, stop_at_eos=False))[
                0
            ]
            key.write_text(json.dumps({"output": ref}))
        for comp in args.kinds_compressors or [args.compressor]:
            for ngram in (0, args.ngram):
                cfg = ServingConfig(
                    policy="vericache",
                    compressor=comp,
                    k_max=args.k_max,
                    link_bytes_per_s=args.link_gbps * 1e9,
                    alpha_prior=args.alpha,
                    ngram=ngram,
                    obs_window=engine.obs_window,
                    draft_dtype=args.draft_dtype,
                )
                rep = ServingEngine(model, cfg, store).run([Request("r0", ids, args.new)])
                r = rep.requests[0]
                rows.append(
                    dict(
                        prompt=name,
                        kind=kind,
                        prompt_tokens=len(ids),
                        compressor=comp,
                        ngram=ngram,
                        accepted_per_verify=rep.mean_accepted,
                        verifications=rep.verifications,
                        ngram_drafted=r.ngram_drafted,
                        tokens_per_s=rep.tokens_per_s,
                        identical=r.output == ref,
                        load_avg=os.getloadavg()[0],
                    )
                )
                print(
                    f"{name} {comp} ngram {ngram}: A {rep.mean_accepted:.2f} over {rep.verifications} verifications, "
                    f"{r.ngram_drafted} n-gram drafts, identical {r.output == ref}",
                    file=sys.stderr,
                )
    lines = [
        f"`{cmd}`",
        "",
        "| prompt | kind | tokens | compressor | A without n-gram | A with n-gram | n-gram drafts | identical |",
        "|---|---|---:|---|---:|---:|---:|---|",
    ]
    for a, b in zip(rows[::2], rows[1::2]):
        lines.append(
            f"| {a['prompt']} | {a['kind']} | {a['prompt_tokens']} | {a['compressor']} | "
            f"{a['accepted_per_verify']:.2f} | {b['accepted_per_verify']:.2f} | {b['ngram_drafted']} | "
            f"{'yes' if a['identical'] and b['identical'] else 'NO'} |"
        )
    text = "\n".join(lines) + "\n"
    doc = {"summary": rows, "command": cmd, "new_tokens": args.new, "k_max": args.k_max, "link_gbps": args.link_gbps}
    (out / "results.json").write_text(json.dumps(doc, indent=2))
    (out / "table.md").write_text(text)
    print(text)
    print(f"results in {out}", file=sys.stderr)
    return 0 if all(r["identical"] for r in rows) else 1


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
            "sweep": r["sweep"],
            "budget_fraction": r["budget_fraction"],
            "rate": r["rate"],
            "policy": r["policy"],
            "compressor": args.compressor if r["policy"] != "full" else None,
            "link_gbps": r["link_gbps"] if r["policy"] == "vericache" else None,
            "tokens_per_s": r["tokens_per_s"],
            "ratio_vs_full": r["ratio_vs_full"],
            "identical": r["identical"],
            "requests": r["requests"],
            "mean_accepted": r["mean_accepted"],
            "load_avg": r["load_avg"],
            "served_policy": r.get("served_policy", r["policy"]),
            "capacity_model": r.get("capacity_model", False),
            "predicted_speedup": r.get("predicted_speedup"),
            "alpha": r.get("alpha"),
            "capacity_alpha": r.get("capacity_alpha"),
        }
        for r in rows
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
        "proxy": EMULATED.format(link=args.link_gbps, links=args.links) + "; prefills computed once, replayed",
        "load_avg": os.getloadavg(),
    }
    (out / "results.json").write_text(json.dumps(doc, indent=2))
    (out / "table.md").write_text(table(rows, args, ctx["demand"], ctx["prefill_s"], ctx["cmd"]))
    return doc


def fmt_row(r) -> str:
    return (
        f"{r['sweep']} {r['budget_fraction']:g} rate {r['rate']} {policy_label(r)}: {r['tokens_per_s']:.2f} tok/s, "
        f"identical {r['identical_n']}/{r['requests']}, concurrent {r['max_concurrent']}, "
        f"accepted/verify {r['mean_accepted']:.2f}, link {r['link_utilization']:.0%}"
    )


def policy_label(r) -> str:
    """vericache rows asked the capacity model: its predicted speedup and what it served."""
    if not r.get("capacity_model"):
        return r["policy"]
    pred = r.get("predicted_speedup")
    return f"{r['policy']} + capacity model ({'-' if pred is None else f'{pred:.2f}x'}: served {r['served_policy']})"


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
            f"{r['link_gbps'] if r['policy'] == 'vericache' else '-'} | {policy_label(r)} | "
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
        for policy, planned in dict.fromkeys((r["policy"], r.get("capacity_model", False)) for r in sel):
            pts = sorted(
                ((r[xkey], r) for r in sel if (r["policy"], r.get("capacity_model", False)) == (policy, planned)),
                key=lambda p: p[0],
            )
            xs = [x for x, _ in pts]
            name = policy + (" + capacity model" if planned else "")
            axes[0].plot(xs, [r["tokens_per_s"] for _, r in pts], marker="o", label=name)
            axes[1].plot(xs, [r["mean_latency_s"] for _, r in pts], marker="o", label=name)
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
