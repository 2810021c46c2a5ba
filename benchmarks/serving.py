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

import sys
from pathlib import Path

if not __package__:  # run as a file (python benchmarks/<script>.py): import from the repository root, as -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import dataclasses
import hashlib
import json
import random
import statistics
import time

from tqdm.auto import tqdm

from benchmarks.kit import load as kit_load
from benchmarks.kit import paths
from benchmarks.kit.plots import lines, pyplot, save
from benchmarks.kit.results import Results

EMULATED = (
    "CPU proxy: the device KV budget is a byte cap on the resident caches and the host link is EMULATED on the CPU "
    "(real copies on a copy thread, paced to {link} GB/s; link rows {links}); the compute is real"
)


def parse_args(argv=None):
    paths.setup()
    from vericache_connector.engine.config import POLICIES

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=6, help="requests in the trace")
    p.add_argument("--min-tokens", type=int, default=4096, help="shortest prompt")
    p.add_argument("--max-tokens", type=int, default=6144, help="longest prompt")
    p.add_argument("--new", type=int, default=64, help="new tokens per request")
    p.add_argument(
        "--budgets",
        type=float,
        nargs="*",
        default=[0.1, 0.15, 0.2, 0.25, 0.35, 0.5],
        help="(b) budget fractions of the trace's full-KV demand",
    )
    p.add_argument(
        "--rates",
        type=float,
        nargs="*",
        default=[],
        help="(a) Poisson arrival rates, requests/s (at --rate-budget; none by default)",
    )
    p.add_argument("--rate-budget", type=float, default=0.25)
    p.add_argument(
        "--links",
        type=float,
        nargs="*",
        default=[0.08],
        help="(c) VeriCache at every budget with these host links too, GB/s (0.08: the H200's HBM:PCIe "
        "ratio on this CPU; --link-gbps 0.5: GH200's C2C ratio; see docs/serving.md)",
    )
    p.add_argument("--link-gbps", type=float, default=0.5, help="emulated host link, GB/s")
    p.add_argument("--compressor", default="snapkv-4x")
    p.add_argument("--k-max", type=int, default=64)
    p.add_argument("--alpha", type=float, default=0.8, help="prior per-draft acceptance (measured curve)")
    p.add_argument("--policies", nargs="+", default=["full", "vericache"], choices=POLICIES)
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
        "--planner",
        choices=["on", "off", "both"],
        default="both",
        help="VeriCache with the planner and the guard on (the engine's default: the capacity model, with this CPU's "
        "figures calibrated from the budget's full-KV run, admits rows on full KV where it predicts VeriCache does "
        "not pay, and the guard moves rows to full KV where their measured rate loses), off, or both: off first, "
        "then on, given the per-row acceptance and the step overheads the run without them measured",
    )
    p.add_argument("--fallback", choices=["on", "both"], nargs="?", const="on", help=argparse.SUPPRESS)  # old name
    p.add_argument(
        "--margin",
        type=float,
        default=0.1,
        help="the planner serves VeriCache only where it predicts at least 1 + this x full KV (the engine's default)",
    )
    args = p.parse_args(argv)
    args.planner = args.fallback or args.planner
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
    model,
    policy,
    budget,
    args,
    reqs,
    refs,
    store,
    label,
    link_gbps=None,
    hardware=None,
    prefill_s=0.0,
    guarded=False,
    alpha_rows=(),
):
    """One run of the trace; guarded: the planner and the guard on (they act with hardware), else both off (the
    capacity model then only predicts, and the engine measures its overheads). A budget too small for even one
    request: a row that says so (fits False)."""
    from vericache_connector.engine.config import ServingConfig
    from vericache_connector.engine.report import observed_alpha
    from vericache_connector.engine.serving import ServingEngine

    cfg = ServingConfig(
        hardware=hardware,
        prefill_s=prefill_s,
        policy=policy,
        budget_bytes=budget,
        compressor=args.compressor,
        k_max=args.k_max,
        link_bytes_per_s=(link_gbps or args.link_gbps) * 1e9,
        alpha_prior=args.alpha,
        alpha_rows=tuple(alpha_rows),
        draft_dtype=args.draft_dtype,
        planner=guarded,
        guard=guarded,
        fallback_margin=args.margin,
    )
    base = dict(policy=policy, requests=len(reqs), link_gbps=link_gbps or args.link_gbps, capacity_model=guarded)
    total = sum(r.max_new_tokens for r in reqs)
    load0 = kit_load.now()
    try:
        with tqdm(total=total, desc=label, unit="tok", leave=False) as bar:
            rep = ServingEngine(model, cfg, store).run(reqs, on_tokens=bar.update)
    except ValueError as e:  # the budget holds not even one request this way
        return {**base, "fits": False, "error": str(e), "identical": True, "identical_n": 0, "tokens_per_s": 0.0}
    load = (load0 + kit_load.now()) / 2  # other work on the machine during the run (same-run ratios)
    outs = rep.outputs()
    same = sum(outs[r.request_id] == refs[r.request_id] for r in reqs)
    row = {k: v for k, v in rep.summary().items() if k != "split"}
    row.update({f"{k}": v for k, v in vars(rep.split).items()})
    row.update(
        base,
        fits=True,
        identical_n=same,
        load_avg=load,
        accepted_per_request={r.request_id: r.accepted for r in rep.requests} if policy == "vericache" else {},
        row_alphas=[observed_alpha(r.accepted, r.drafted) for r in rep.requests if r.drafted],
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
    paths.setup()
    import torch

    if args.kinds is not None:
        return kinds_main(args, argv)

    from vericache_connector.engine import DecodeConfig, VeriCacheEngine

    torch.set_num_threads(args.threads)
    load = kit_load.LoadAverage().start()
    out = Results.create(args.out, argv)
    cmd = out.command
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
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.planner]
    flops = cpu_flops(model) if "vericache" in args.policies else None
    rates, pre_s = None, 0.0
    if flops:  # the attention kernels as the VeriCache rows run them, timed at the trace's mean prompt
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
    grid = [
        g
        for b in sorted(args.budgets, reverse=True)  # the largest first: its full-KV run calibrates the CPU's figures
        for g in [("budget", b, None, None)] + [("link", b, None, x) for x in args.links]
    ] + [("rate", args.rate_budget, r, None) for r in args.rates]
    context = dict(demand=demand, prompts=prompts, prefill_s=prefill_s, cmd=cmd, threads=torch.get_num_threads())
    context["load"] = load
    for kind, frac, rate, link in grid:
        reqs = trace(prompts, args.new, rate, args.seed)
        for policy in args.policies:
            if kind == "link" and policy != "vericache":  # only VeriCache uses the link: its baseline is the budget row
                continue
            label = f"{kind} {frac:g}{'' if rate is None else f' @ {rate:g}/s'}{'' if link is None else f' {link:g} GB/s'} {policy}"
            for guarded in modes if policy == "vericache" else [False]:
                hw, seen, added = None, [], pre_s
                if policy == "vericache":  # the CPU's figures from this budget's full-KV run (or the last that ran)
                    fulls = [r for r in rows if r["policy"] == "full" and r.get("fits")]
                    base = next((r for r in fulls if r["budget_fraction"] == frac), fulls[-1] if fulls else None)
                    if base is not None:
                        hw = cpu_hardware(base, model, prompts, (link or args.link_gbps) * 1e9, flops, rates)
                    off = rows[-1] if guarded and len(modes) == 2 else None  # what the unguarded run just measured
                    if hw is not None and off is not None and off.get("step_overhead_s") is not None:
                        hw = dataclasses.replace(
                            hw, step_overhead_s=off["step_overhead_s"], verify_overhead_s=off["verify_overhead_s"]
                        )
                    seen = off.get("row_alphas", []) if off is not None else []
                    # what a VeriCache prefill adds: measured by the unguarded run where it ran, else calibrated
                    measured = None if off is None else off.get("prefill_overhead_s")
                    added = pre_s if measured is None else measured
                row = run_one(
                    model,
                    policy,
                    int(frac * demand),
                    args,
                    reqs,
                    refs,
                    store,
                    label + (" + planner + guard" if guarded else ""),
                    link,
                    hw,
                    added if hw else 0.0,
                    guarded,
                    seen,
                )
                row.update(sweep=kind, budget_fraction=frac, rate=rate, capacity_alpha=seen or args.alpha)
                rows.append(row)
                print(fmt_row(row), file=sys.stderr)
                write(out, rows, args, context, complete=False)  # after every row: a crash keeps what was measured
    load.stop()
    doc = write(out, rows, args, context, complete=True)
    plot(rows, out.path, args)
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
    load = kit_load.LoadAverage().start()
    out = Results.create(args.out, argv, suffix="-kinds")
    cmd = out.command
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
                        load_avg=kit_load.now(),
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
    out.write(doc | {"load_avg": load.stop()}, text)
    print(text)
    print(f"results in {out}", file=sys.stderr)
    return 0 if all(r["identical"] for r in rows) else 1


def write(out: Results, rows: list[dict], args, ctx: dict, complete: bool) -> dict:
    """results.json and table.md of the rows so far; ratio_vs_full against the full-KV run of the same trace and
    budget (link rows: the budget sweep's; None where full KV does not fit the budget)."""
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
                and r.get("fits", True)
            ),
            None,
        )
        row["ratio_vs_full"] = None if base is None else row["tokens_per_s"] / base["tokens_per_s"]
    keys = ("tokens_per_s", "ratio_vs_full", "identical", "requests", "mean_accepted", "load_avg", "predicted_speedup")
    summary = [
        {
            "sweep": r["sweep"],
            "budget_fraction": r["budget_fraction"],
            "rate": r["rate"],
            "policy": r["policy"],
            "compressor": args.compressor if r["policy"] != "full" else None,
            "link_gbps": r["link_gbps"] if r["policy"] == "vericache" else None,
            **{k: r.get(k) for k in keys},
            "fits": r.get("fits", True),
            "served_policy": r.get("served_policy", r["policy"]),
            "capacity_model": r.get("capacity_model", False),
            "moved_by_guard": r.get("moved_by_guard"),
            "alpha": r.get("alpha"),
            "capacity_alpha": r.get("capacity_alpha"),
        }
        for r in rows
    ]
    doc = {
        "summary": summary,
        "wins": wins(rows),
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
        "load_avg": ctx["load"].record(),  # so far (before, during), until the run's end
    }
    out.write(doc, table(rows, args, ctx["demand"], ctx["prefill_s"], ctx["cmd"]))
    return doc


def fmt_row(r) -> str:
    if not r.get("fits", True):
        return f"{r['sweep']} {r['budget_fraction']:g} {policy_label(r)}: does not fit ({r['error']})"
    return (
        f"{r['sweep']} {r['budget_fraction']:g} rate {r['rate']} {policy_label(r)}: {r['tokens_per_s']:.2f} tok/s, "
        f"identical {r['identical_n']}/{r['requests']}, concurrent {r['max_concurrent']}, "
        f"accepted/verify {r['mean_accepted']:.2f}, link {r['link_utilization']:.0%}"
    )


def policy_label(r) -> str:
    """vericache rows with the planner and the guard on: the predicted speedup, what was served, rows moved."""
    if not r.get("capacity_model"):
        return r["policy"]
    if not r.get("fits", True):
        return f"{r['policy']} + planner + guard"
    pred = r.get("predicted_speedup")
    moved = f", {r['moved_by_guard']} moved by the guard" if r.get("moved_by_guard") else ""
    return (
        f"{r['policy']} + planner + guard ({'-' if pred is None else f'{pred:.2f}x'}: served {r['served_policy']}"
        f"{moved})"
    )


def wins(rows: list[dict]) -> list[dict]:
    """Per budget and link: full KV, VeriCache alone and with the planner and guard, and whether VeriCache beats
    full KV there (tokens/s ratio > 1; where full KV does not fit even one request, any VeriCache that runs)."""
    out = []
    for r in rows:
        if (
            r["policy"] != "vericache"
            or r["sweep"] == "rate"
            or any((o["budget_fraction"], o["link_gbps"]) == (r["budget_fraction"], r["link_gbps"]) for o in out)
        ):
            continue
        same = [
            o
            for o in rows
            if o["policy"] == "vericache"
            and (o["budget_fraction"], o["link_gbps"], o["sweep"]) == (r["budget_fraction"], r["link_gbps"], r["sweep"])
        ]
        full = next((o for o in rows if o["policy"] == "full" and o["budget_fraction"] == r["budget_fraction"]), None)
        entry = {"budget_fraction": r["budget_fraction"], "link_gbps": r["link_gbps"]}
        entry["full_tokens_per_s"] = full["tokens_per_s"] if full and full.get("fits", True) else None
        for o in same:
            key = "guarded" if o.get("capacity_model") else "alone"
            entry[key] = (
                o["ratio_vs_full"] if entry["full_tokens_per_s"] else (None if not o.get("fits", True) else "∞")
            )
            entry[key + "_served"] = o.get("served_policy") if o.get("fits", True) else "does not fit"
        out.append(entry)
    return out


def wins_table(rows: list[dict]) -> list[str]:
    def x(v):
        return "-" if v is None else (v if isinstance(v, str) else f"{v:.2f}x")

    lines = [
        "",
        "Where VeriCache beats full KV (tokens/s against the full-KV run at the same budget; ∞: full KV cannot hold one "
        "request there):",
        "",
        "| budget | link GB/s | full KV tok/s | VeriCache alone | VeriCache + planner + guard | served |",
        "|---|---|---|---|---|---|",
    ]
    for e in wins(rows):
        full = "does not fit" if e["full_tokens_per_s"] is None else f"{e['full_tokens_per_s']:.2f}"
        lines.append(
            f"| {e['budget_fraction']:g} | {e['link_gbps']:g} | {full} | {x(e.get('alone'))} | {x(e.get('guarded'))} | "
            f"{e.get('guarded_served', e.get('alone_served', '-'))} |"
        )
    beats = [e for e in wins(rows) for k in ("alone", "guarded") if e.get(k) == "∞" or (e.get(k) or 0) > 1]
    where = sorted({(e["budget_fraction"], e["link_gbps"]) for e in beats})
    lines += ["", "VeriCache beats full KV at (budget, link GB/s): " + (", ".join(map(str, where)) or "nowhere")]
    guarded = [e["guarded"] for e in wins(rows) if isinstance(e.get("guarded"), float)]
    if guarded:
        lines.append(f"With the planner and guard, VeriCache / full KV is {min(guarded):.2f}x at worst")
    return lines


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
        link = r["link_gbps"] if r["policy"] == "vericache" else "-"
        head = f"| {r['sweep']} | {r['budget_fraction']:g} | {'-' if r['rate'] is None else r['rate']} | {link} | "
        if not r.get("fits", True):
            lines.append(head + f"{policy_label(r)} | does not fit the budget |" + " |" * 14)
            continue
        ratio = "-" if r["ratio_vs_full"] is None else f"{r['ratio_vs_full']:.2f}"
        lines.append(
            head + f"{policy_label(r)} | "
            f"{r['tokens_per_s']:.2f} | {ratio} | {'yes' if r['identical'] else 'NO'} {r['identical_n']}/{r['requests']} | "
            f"{r['max_concurrent']} | {r['mean_latency_s']:.1f} | {r['p90_latency_s']:.1f} | {r['mean_ttft_s']:.1f} | "
            f"{r['mean_accepted']:.2f} | {r['link_utilization']:.0%} | {r['peak_resident_bytes'] / 2**20:.0f} | "
            f"{r['draft_step_s']:.1f} | {r['verify_step_s']:.1f} | {r['decode_step_s']:.1f} | {r['link_wait_s']:.1f} | "
            f"{r['idle_s']:.1f} |"
        )
    return "\n".join(lines + wins_table(rows)) + "\n"


def plot(rows, out: Path, args) -> None:
    plt = pyplot()
    for sweep, xkey, xlabel in (
        ("budget", "budget_fraction", "device KV budget (fraction of the trace's full-KV demand)"),
        ("rate", "rate", "arrival rate (requests/s)"),
    ):
        sel = [r for r in rows if r["sweep"] == sweep and r.get("fits", True)]
        if not sel:
            continue
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        sel = [{**r, "line": r["policy"] + (" + planner + guard" if r.get("capacity_model") else "")} for r in sel]
        lines(axes[0], sel, "line", xkey, "tokens_per_s")
        lines(axes[1], sel, "line", xkey, "mean_latency_s")
        axes[0].set_ylabel("output tokens/s")
        axes[1].set_ylabel("mean latency (s)")
        for ax in axes:
            ax.set_xlabel(xlabel)
            ax.grid(alpha=0.3)
            ax.legend()
        fig.suptitle(f"serving on the CPU proxy (link {args.link_gbps} GB/s emulated, {args.compressor})")
        save(fig, out / f"{sweep}.png")


if __name__ == "__main__":
    sys.exit(main())
