"""Acceptance vs draft horizon x for every compressor at two ratios, the ideal speedup of the paper's
Fig. 8 with measured costs, and the per-round accepted counts as replayable traces.

Greedy, float32 on CPU, one row per prompt (batch 1); the draft cache and weights of --draft-layout,
--draft-dtype, --draft-weights (default: the engine's default, paged float16 on the CPU, model weights).

    python benchmarks/acceptance.py                                  # the issue-15 sweep (defaults below)
    python benchmarks/acceptance.py --compressors kivi4 kvzip-5x --xs 8 25 --prompts graphlib_py --new-tokens 32

Method (benchmarks/acceptance_oracle.py): a greedy round's accepted count depends only on the state it
starts from, so per compressor and prompt the drafter is rolled out once from each state some horizon
visits (until its first miss, at most as far as the largest horizon visiting it needs) and every
horizon's per-round counts follow. The rollouts of all compressors of a prompt run batched, one draft
cache row per compressor (at most --rows per cache; copies with per-head budgets in caches of their
own). The ideal-speedup costs are batch-1 measurements.
Checked in the same run, per compressor: one real batched VeriCache run (speculative_decode) at
x = --check-x on the shortest prompt must give the full-KV greedy output token for token ("identical")
and the per-round accepted counts derived for that batch ("rounds as derived").

Reported per compressor and x (pooled over the rounds of all prompts):
  mean accepted length = accepted drafts / rounds;  acceptance rate = accepted drafts / drafted tokens;
  ideal speedup = tokens emitted (accepted + 1 bonus per round) per unit of time, relative to full-KV
  decoding's one token per step: sum(n_r + 1) / sum(k_r c_draft + c_verify(k_r)), with costs measured
  at batch 1 at each prompt's context in units of a one-token full-KV step, each measured right beside
  a full step (round-robin medians): c_draft = a draft step on the compressor's draft cache,
  c_verify(k) = a forward of k + 1 tokens on the full KV. No overlap, batching or transfer effects: the
  paper's ideal curve (Fig. 8) on this machine's costs.

Outputs, results/acceptance/<stamp>/: table.md, results.json, command.txt, mean_accepted.png,
acceptance_rate.png, ideal_speedup.png and traces.json, which the serving benchmark and the GPU script
replay:
    {"model": str, "new_tokens": N, "prompts": [{"name": str, "tokens": int}],
     "runs": [{"compressor": spec, "k": x, "prompt": name, "accepted": [n_1, n_2, ...],
               "drafted": [k_1, k_2, ...]}]}
  accepted[r] = drafts accepted in round r (0 <= n_r <= k_r); drafted[r] = drafts round r made (x, or
  fewer in a last round that needs fewer: engine.speculative.draft_horizon); every round also emits one
  bonus token, and the first token comes from the prefill, so 1 + sum(n_r + 1) >= N.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file (python benchmarks/<script>.py): import from the repository root, as -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import gc
import json
import time

import numpy as np
from tqdm.auto import tqdm

from benchmarks.kit import paths
from benchmarks.kit.load import LoadAverage
from benchmarks.kit.plots import pyplot, save
from benchmarks.kit.results import Results

DEFAULT_COMPRESSORS = [
    "streamingllm-4x",
    "streamingllm-8x",
    "snapkv-4x",
    "snapkv-8x",
    "tova-4x",
    "tova:ratio=8",
    "knorm-4x",
    "knorm:ratio=8",
    "expected-attention-4x",
    "expected-attention-8x",
    "adakv-ea-4x",
    "adakv-ea-8x",
    "kvzip-4x",
    "kvzip-5x",
    "kvzip-8x",
    "pyramidkv-4x",
    "press:pyramidkv:ratio=8",
    "kivi4",
    "kivi2",
    "kvquant4",
    "kvquant2",
    "rotatekv4",
    "rotatekv2",
    "turboquant-k4v3",
    "turboquant-k3v2",
    "int8",
    "fp8",
]
DEFAULT_PROMPTS = ["graphlib_py", "chat_tool_call_inventory", "chat_customization_qa"]
DEFAULT_XS = [4, 8, 16, 24, 25, 32, 40, 50]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compressors", nargs="+", default=DEFAULT_COMPRESSORS)
    p.add_argument("--prompts", nargs="+", default=DEFAULT_PROMPTS, help="bundled (.txt) or chat prompt names")
    p.add_argument("--xs", "--ks", nargs="+", type=int, default=DEFAULT_XS, help="draft horizons")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--check-x", type=int, default=8, help="horizon of the real-decoding check (0: no check)")
    p.add_argument("--rows", type=int, default=8, help="compressors per batched draft cache (memory)")
    p.add_argument("--model", default=None)
    p.add_argument("--draft-layout", default="auto", help="DraftConfig.layout: auto paged dense materialized ...")
    p.add_argument("--draft-dtype", default="auto", help="DraftConfig.dtype (paged: fp8_e4m3 fp8_e5m2 bfloat16 ...)")
    p.add_argument("--draft-weights", default="model", help="DraftConfig.weights: model bfloat16 int8")
    p.add_argument("--out", default="results/acceptance")
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    return p.parse_args(argv)


def compress_all(comps, pre):
    """Per compressor, per prompt, the compressed copy; kvpress presses share model runs per prompt."""
    from vericache_connector.compressors.press import PressCompressor, compress_many

    out = {i: [] for i in range(len(comps))}
    press = [i for i, c in enumerate(comps) if isinstance(c, PressCompressor)]
    seconds = dict.fromkeys(range(len(comps)), 0.0)
    for p in tqdm(pre, desc="compress", leave=False):
        t = time.perf_counter()
        for i, c in zip(press, compress_many([comps[i] for i in press], p.prefix) if press else []):
            out[i].append(c)
        for i in press:
            seconds[i] += (time.perf_counter() - t) / len(press)
        for i, comp in enumerate(comps):
            if i not in press:
                t = time.perf_counter()
                out[i].append(comp.compress(p.prefix))
                seconds[i] += time.perf_counter() - t
    return [out[i] for i in range(len(comps))], [seconds[i] for i in range(len(comps))]


def ideal_speedup(acc, drafted, c_draft, costs) -> float:
    """Tokens emitted per unit of time over full-KV decoding's one token per step (see the module doc):
    sum(n_r + 1) / sum(k_r c_draft + c_verify(k_r)), costs in full-KV steps (c_verify interpolated
    between the measured horizons)."""
    ks = sorted(costs["verify_ratio"])
    cv = np.interp(list(drafted), ks, [costs["verify_ratio"][k] for k in ks])
    cost = sum(k * c_draft for k in drafted) + float(cv.sum())
    return sum(n + 1 for n in acc) / cost if cost else float("nan")


def plot(rows, names, xs, key, ylabel, path, diagonal=False):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 5.5))
    cmap = plt.get_cmap("tab20")
    for i, name in enumerate(names):
        ys = [next(r[key] for r in rows if r["compressor"] == name and r["k"] == x) for x in xs]
        ax.plot(xs, ys, marker="o", ms=3, lw=1.2, color=cmap(i % 20), ls="-" if i < 20 else "--", label=name)
    if diagonal:
        ax.plot(xs, xs, "k:", label="all accepted")
    if key == "ideal_speedup":
        ax.axhline(1.0, color="k", ls=":", lw=1, label="full-KV decoding")
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("draft horizon x")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    save(fig, path)


def real_check(engine, orc, prefill, copies, ref, args, chunk) -> dict:
    """One real batched VeriCache run over this chunk's copies of one prompt at x = --check-x: per
    compressor, whether the output is the full-KV greedy output and the rounds are the derived ones."""
    from benchmarks import acceptance_oracle as O
    from vericache_connector.engine import DecodeConfig
    from vericache_connector.engine.speculative import speculative_decode

    n_new, x = args.new_tokens, args.check_x
    want, _ = O.derive_batched([orc.accepted_at(b) for b in range(len(copies))], x, n_new)
    cfg = DecodeConfig(max_new_tokens=n_new, draft_k=x, k_min=1, k_max=x, stop_at_eos=False)
    extra = n_new + max(args.xs) + 2
    rows = [prefill] * len(copies)
    outs, stats = speculative_decode(
        engine.model,
        engine.full_cache(rows, extra),
        engine.draft_cache(copies, extra),
        engine.first_tokens(rows, cfg),
        cfg,
        draft_model=engine.draft_model(),
    )
    return {
        args.compressors[i]: {
            "x": x,
            "batch": len(copies),
            "identical": outs[b] == ref[:n_new],
            "rounds_as_derived": stats.accepted[b] == want[b],
        }
        for b, i in enumerate(chunk)
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if min(args.xs) < 1 or args.new_tokens < 2 or not 0 <= args.check_x <= max(args.xs):
        raise SystemExit("need horizons >= 1, --new-tokens >= 2 and 0 <= --check-x <= max(--xs)")
    paths.setup()
    import torch

    from benchmarks import acceptance_oracle as O
    from vericache_connector.compressors import get_compressor
    from vericache_connector.data.chat_prompts import load_any_prompt
    from vericache_connector.draft import DraftConfig
    from vericache_connector.engine import DecodeConfig, VeriCacheEngine

    started, load = time.perf_counter(), LoadAverage().start()
    xs, n_new, k_max = sorted(set(args.xs)), args.new_tokens, max(args.xs)
    comps = [get_compressor(c) for c in args.compressors]
    draft = DraftConfig(args.draft_layout, args.draft_dtype, weights=args.draft_weights)
    engine = VeriCacheEngine.from_pretrained(args.model, draft=draft)  # every draft cache below: this config
    texts = {name: load_any_prompt(name, engine.tokenizer) for name in args.prompts}
    pre = [engine.prefill(engine.encode(t)) for t in tqdm(texts.values(), desc="prefill", leave=False)]
    # full-KV greedy reference, long enough for a rollout from any state: N + max(x) tokens
    refs = engine.generate_full(pre, DecodeConfig(max_new_tokens=n_new + k_max, stop_at_eos=False))
    exact = [O.exact_cache(engine, p, r) for p, r in zip(pre, refs)]
    costs = [O.step_costs(engine, p, xs) for p in tqdm(pre, desc="costs", leave=False)]
    compressed, compress_s = compress_all(comps, pre)
    full_bytes = sum(p.prefix.nbytes for p in pre)
    bytes_ratio = [sum(c.nbytes for c in copies) / full_bytes for copies in compressed]
    from vericache_connector.compressors import kvpress_bridge
    from vericache_connector.compressors.heads import is_per_head

    kvpress_bridge.hf_model.cache_clear()  # the presses' transformers model is not needed any more
    gc.collect()

    # per prompt: every compressor's copy a row of one draft cache (in chunks), all horizons derived
    traces, c_draft, checks = {}, {}, {}
    order = sorted(range(len(pre)), key=lambda j: pre[j].num_tokens)
    # rows of one draft cache: per-head copies apart (their cache has a row per KV head), at most --rows
    chunks = []
    for per_head in (False, True):
        group = [i for i in range(len(comps)) if is_per_head(compressed[i][0]) == per_head]
        chunks += [group[s : s + args.rows] for s in range(0, len(group), args.rows)]
    for j in tqdm(order, desc="rollouts (prompts)", leave=False):
        for chunk in chunks:
            orc = O.BatchOracle(engine, pre[j], [compressed[i][j] for i in chunk], refs[j], exact[j], k_max)
            for i, per_k in zip(chunk, orc.traces(sorted(xs, reverse=True), n_new)):
                for x, trace in per_k.items():
                    traces[i, j, x] = trace
            if args.check_x and j == order[0]:  # the shortest prompt: one real batched run per chunk
                checks.update(real_check(engine, orc, pre[j], [compressed[i][j] for i in chunk], refs[j], args, chunk))
            del orc
        for i in range(len(comps)):
            c_draft[i, j] = O.draft_step_ratio(engine, pre[j], compressed[i][j])
            compressed[i][j] = None  # done with this prompt's copies
        gc.collect()

    rows, runs = [], []
    for i, (name, comp) in enumerate(zip(args.compressors, comps)):
        for x in xs:
            acc = [traces[i, j, x][0] for j in range(len(pre))]
            dr = [traces[i, j, x][1] for j in range(len(pre))]
            flat_a = [n for a in acc for n in a]
            flat_d = [k for d in dr for k in d]
            sp = [ideal_speedup(acc[j], dr[j], c_draft[i, j], costs[j]) for j in range(len(pre))]
            rows.append(
                {
                    "compressor": name,
                    "spec": comp.spec,
                    "k": x,
                    "mean_accepted": sum(flat_a) / len(flat_a),
                    "mean_accepted_per_prompt": float(np.mean([sum(a) / len(a) for a in acc])),
                    "acceptance_rate": sum(flat_a) / sum(flat_d),
                    "rounds": len(flat_a),
                    "ideal_speedup": float(np.mean(sp)),
                    "ideal_speedup_per_prompt": sp,
                    "draft_step_over_full_step": float(np.mean([c_draft[i, j] for j in range(len(pre))])),
                    "bytes_ratio": bytes_ratio[i],
                    "compress_s": compress_s[i],
                    "prompts": len(pre),
                }
            )
            for j, pn in enumerate(args.prompts):
                runs.append(
                    {"compressor": comp.spec, "name": name, "k": x, "prompt": pn, "accepted": acc[j], "drafted": dr[j]}
                )

    out = Results.create(args.out, argv)
    cmd = out.command
    lens = [p.num_tokens for p in pre]
    wall = time.perf_counter() - started
    table = render_table(args, rows, checks, lens, costs, engine, cmd, wall, torch.get_num_threads())
    prompts = [{"name": n, "tokens": t} for n, t in zip(args.prompts, lens)]
    out.write_json(
        "traces.json", {"model": engine.model_name, "new_tokens": n_new, "prompts": prompts, "runs": runs}, None
    )
    doc = {"command": cmd, "seconds": wall, "prompts": prompts, "costs": costs, "checks": checks, "rows": rows}
    out.write(doc | {"load_avg": load.stop()}, table, indent=1)
    names = list(args.compressors)
    plot(rows, names, xs, "mean_accepted", "mean accepted length (drafts per round)", out / "mean_accepted.png", True)
    plot(rows, names, xs, "acceptance_rate", "acceptance rate (accepted / drafted)", out / "acceptance_rate.png")
    plot(rows, names, xs, "ideal_speedup", "ideal speedup over full-KV decoding", out / "ideal_speedup.png")
    print(json.dumps(doc, indent=1) if args.json else table)
    print(f"wrote {out} ({wall:.0f} s)", file=sys.stderr)
    ok = all(c["identical"] for c in checks.values())
    return 0 if ok else 1


def render_table(args, rows, checks, lens, costs, engine, cmd, wall, threads) -> str:
    xs = sorted(set(args.xs))
    names = list(args.compressors)

    def grid(key, fmt):
        lines = [
            "| compressor | bytes vs full | " + " | ".join(f"x={x}" for x in xs) + " |",
            "|---|---:|" + "---:|" * len(xs),
        ]
        for n in names:
            rs = {r["k"]: r for r in rows if r["compressor"] == n}
            lines.append(f"| {n} | {rs[xs[0]]['bytes_ratio']:.3f} | " + " | ".join(fmt(rs[x]) for x in xs) + " |")
        return lines

    full_ms = [c["full_step_s"] * 1e3 for c in costs]
    verify = " / ".join(f"x={x}: {np.mean([c['verify_ratio'][x] for c in costs]):.2f}" for x in xs)
    out = [
        f"Greedy VeriCache on {engine.model_name}, float32 CPU ({threads} threads), batch 1, draft cache "
        f"{engine.draft.describe(engine.model.device)} ({args.draft_dtype}); "
        f"{len(lens)} prompts ({', '.join(f'{n} {t}' for n, t in zip(args.prompts, lens))} tokens), "
        f"{args.new_tokens} new tokens. Per-round counts derived from one set of draft rollouts per compressor and "
        f"prompt (benchmarks/acceptance_oracle.py). Command: `{cmd}` ({wall / 60:.1f} min).",
        "",
        "Mean accepted length (accepted drafts per round, pooled over all rounds of all prompts):",
        "",
        *grid("mean_accepted", lambda r: f"{r['mean_accepted']:.1f}"),
        "",
        "Acceptance rate (accepted / drafted tokens):",
        "",
        *grid("acceptance_rate", lambda r: f"{r['acceptance_rate']:.2f}"),
        "",
        "Ideal speedup over full-KV decoding (paper Fig. 8; tokens per unit of draft + verify time, measured costs):",
        "",
        *grid("ideal_speedup", lambda r: f"{r['ideal_speedup']:.2f}"),
        "",
        f"Measured costs, batch 1: full-KV step {', '.join(f'{m:.0f}' for m in full_ms)} ms per prompt; verify "
        f"pass of x + 1 tokens / full step: {verify}.",
        "",
        "Real decoding check: "
        + (
            f"one batched VeriCache run (speculative_decode, batch = the compressors of a chunk of --rows) "
            f"at x = {args.check_x} on {min(zip(lens, args.prompts))[1]}: its output against full-KV greedy, its "
            f"per-round accepted counts against those derived for that batch."
            if checks
            else "not run (--check-x 0)."
        ),
        "",
        "| compressor | draft step / full step | compress s (all prompts) | real decoding check |",
        "|---|---:|---:|---|",
    ]
    for n in names:
        r = next(r for r in rows if r["compressor"] == n)
        chk = checks.get(n)
        yes = {True: "yes", False: "NO"}
        check = (
            f"identical {yes[chk['identical']]}, rounds as derived {yes[chk['rounds_as_derived']]}"
            if chk
            else "not run"
        )
        out.append(f"| {n} | {r['draft_step_over_full_step']:.2f} | {r['compress_s']:.1f} | {check} |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
