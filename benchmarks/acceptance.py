"""Mean accepted drafts per verification, per compressor and draft horizon, on the bundled real prompts.

Greedy, batched over all prompts (one prefill each), float32 on CPU. Checks every output against plain
full-KV greedy decoding and reports it. Writes a table (markdown), JSON, and a plot of acceptance vs
draft length into results/acceptance/<stamp>/ with the exact command.

    python benchmarks/acceptance.py                       # the issue's table: 6 compressors x k=4..32
    python benchmarks/acceptance.py --compressors kivi4 --ks 32 --json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

import bench_paths

DEFAULT_COMPRESSORS = ["streamingllm-4x", "streamingllm-8x", "snapkv-4x", "snapkv-8x", "kivi4", "kivi2"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compressors", nargs="+", default=DEFAULT_COMPRESSORS)
    p.add_argument("--ks", nargs="+", type=int, default=[4, 8, 16, 32])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--model", default=None)
    p.add_argument("--out", default="results/acceptance")
    p.add_argument("--draft-layout", default="auto", help="DraftConfig.layout: auto paged dense materialized ...")
    p.add_argument("--draft-dtype", default="auto", help="DraftConfig.dtype (paged: fp8_e4m3 fp8_e5m2 bfloat16 ...)")
    p.add_argument("--draft-weights", default="model", help="DraftConfig.weights: model bfloat16 int8")
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    return p.parse_args(argv)


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def plot(rows, ks, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for comp in dict.fromkeys(r["compressor"] for r in rows):
        ys = [next(r["mean_accepted"] for r in rows if r["compressor"] == comp and r["k"] == k) for k in ks]
        ax.plot(ks, ys, marker="o", label=comp)
    ax.plot(ks, ks, "k:", label="all accepted")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_xlabel("draft length k")
    ax.set_ylabel("accepted drafts per verification")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    args = parse_args(argv)
    bench_paths.setup()
    from vericache_connector.compressors import get_compressor
    from vericache_connector.data import load_prompts
    from vericache_connector.engine import VeriCacheEngine
    from vericache_connector.engine.speculative import DecodeConfig

    comps = [get_compressor(c) for c in args.compressors]
    from vericache_connector.draft import DraftConfig

    engine = VeriCacheEngine.from_pretrained(
        args.model, draft=DraftConfig(args.draft_layout, args.draft_dtype, weights=args.draft_weights)
    )
    layout = engine.draft.resolve_layout(engine.model.device)
    texts = load_prompts()
    pre = [engine.prefill(engine.encode(t)) for t in tqdm(texts.values(), desc="prefill", leave=False)]
    base = DecodeConfig(max_new_tokens=args.new_tokens, draft_k=max(args.ks), k_max=max(args.ks), stop_at_eos=False)
    t = time.perf_counter()
    reference = engine.generate_full(pre, base)
    full_s = time.perf_counter() - t
    rows = []
    with tqdm(total=len(comps) * len(args.ks), desc="compressor x k") as bar:
        for name, comp in zip(args.compressors, comps):
            compressed = [comp.compress(p.prefix) for p in pre]
            for k in args.ks:
                cfg = DecodeConfig(
                    max_new_tokens=args.new_tokens, draft_k=k, k_min=1, k_max=max(args.ks), stop_at_eos=False
                )
                t = time.perf_counter()
                outs, stats = engine.generate(pre, compressed, cfg)
                per_prompt = [sum(a) / max(1, len(a)) for a in stats.accepted]
                rows.append(
                    {
                        "compressor": name,
                        "k": k,
                        "mean_accepted": stats.mean_accepted(),
                        "mean_accepted_per_prompt": sum(per_prompt) / len(per_prompt),
                        "per_prompt": per_prompt,
                        "identical": sum(o == r for o, r in zip(outs, reference)),
                        "prompts": len(pre),
                        "bytes_ratio": sum(c.nbytes for c in compressed) / sum(p.prefix.nbytes for p in pre),
                        "seconds": time.perf_counter() - t,
                    }
                )
                rows[-1]["speedup_vs_full"] = full_s / rows[-1]["seconds"]
                bar.update(1)
    out = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    cmd = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])])
    lens = [p.num_tokens for p in pre]
    header = (
        "| compressor | bytes vs full | "
        + " | ".join(f"k={k}" for k in args.ks)
        + " | "
        + " | ".join(f"speed k={k}" for k in args.ks)
        + " | identical |"
    )
    lines = [
        f"Mean accepted drafts per verification, greedy, {len(pre)} prompts of {min(lens)}-{max(lens)} "
        f"tokens, {args.new_tokens} new tokens, draft layout {layout} ({args.draft_dtype}), "
        f"draft weights {args.draft_weights}. Each cell: pooled over all verifications / mean of the "
        f"per-prompt means. speed = full-KV greedy decode time / VeriCache decode time, same prompts, "
        f"same process (batched, {torch_threads()} threads). Command: `{cmd}`",
        "",
        header,
        "|" + "---|" * (2 * len(args.ks) + 3),
    ]
    for name in args.compressors:
        rs = [r for r in rows if r["compressor"] == name]
        ident = min(r["identical"] for r in rs)
        lines.append(
            f"| {name} | {rs[0]['bytes_ratio']:.3f} | "
            + " | ".join(f"{r['mean_accepted']:.1f} / {r['mean_accepted_per_prompt']:.1f}" for r in rs)
            + " | "
            + " | ".join(f"{r['speedup_vs_full']:.2f}x" for r in rs)
            + f" | {ident}/{len(pre)} |"
        )
    table = "\n".join(lines)
    (out / "table.md").write_text(table + "\n")
    (out / "results.json").write_text(json.dumps({"command": cmd, "prompt_tokens": lens, "rows": rows}, indent=2))
    (out / "command.txt").write_text(cmd + "\n")
    plot(rows, args.ks, out / "acceptance_vs_k.png")
    print(json.dumps({"command": cmd, "rows": rows}, indent=2) if args.json else table)
    print(f"wrote {out}", file=sys.stderr)
    return 0 if all(r["identical"] == r["prompts"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
