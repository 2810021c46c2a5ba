#!/usr/bin/env python
"""CPU step time of one decode attention step (all layers) over a full vs a compressed KV cache.

    python benchmarks/kernel_step_time.py [--contexts 4096 8192] [--batches 1 8] [--threads 1] [--json]

SmolLM2-135M shapes: 30 layers, Hq 9, Hkv 3, head_dim 64, one new query token (Lq = 1). Variants:
  full      fp32 K/V [B, 3, T, 64] through kernels.verify_attention (the dispatch; CPU -> reference)
  kivi4/2   KIVI keys+values at 4/2 bits (group 32) over the first kivi_split(T, 32, 128) tokens,
            the last 128 tokens as the fp32 residual tail, through kernels.kivi_decode_attention
  turbo4    TurboQuant 4-bit codes (same split) through kernels.turbo_decode_attention
  drop4x    token-dropped cache, T/4 kept positions per KV head gathered from the full fp32 K/V
            each step, through kernels.gathered_attention
  drop4x_c  the same 4x token-dropped cache stored compacted (dense T/4 K/V), verify_attention
  full_fused / full_f16 / drop4x_f16   the engine's CPU draft path, kernels.cache_attention (the fused
            CPU flash kernel, GQA rows stacked) over the full K/V in float32 / float16, and over the
            compacted 4x token-dropped K/V in float16
Each step calls the op once per layer. Layers get distinct cache tensors (cycled when 30 copies
would exceed --mem-mb per variant) so caches do not sit in L3 between layers. Variants are timed
round-robin (fair under background load). Reported: median step time over --steps steps after one
warm-up round, and ratio = variant / full.
On CPU the compressed variants run the torch references (unpack + dequantize, then attend), so
the ratio measures the reference path, not the Triton kernels.
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

from benchmarks.kit import paths

paths.setup()

import torch  # noqa: E402

import vericache_kernels as K  # noqa: E402

LAYERS, HQ, HKV, D, GROUP, RESIDUAL = 30, 9, 3, 64, 32, 128


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(_nbytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(_nbytes(o) for o in obj.values())
    return 0


def make_variant(name: str, b: int, t: int, g: torch.Generator):
    """(make_layer() -> state, step(q, state) -> out) for one variant."""

    def rnd(*s):
        return torch.randn(*s, generator=g)

    tq = K.kivi_split(t, GROUP, RESIDUAL)
    if name == "full":
        return (lambda: (rnd(b, HKV, t, D), rnd(b, HKV, t, D)), lambda q, s: K.verify_attention(q, *s))
    if name.startswith("kivi"):
        bits = int(name[4:])

        def mk():
            k, v = rnd(b, HKV, t, D), rnd(b, HKV, t, D)
            return (
                K.kivi_quantize_keys(k[:, :, :tq], bits, GROUP),
                K.kivi_quantize_values(v[:, :, :tq], bits, GROUP),
                k[:, :, tq:].clone(),
                v[:, :, tq:].clone(),
            )

        return mk, lambda q, s: K.kivi_decode_attention(
            q, *s[0], *s[1], bits=bits, k_group=GROUP, v_group=GROUP, k_tail=s[2], v_tail=s[3]
        )
    if name.startswith("turbo"):
        bits = int(name[5:])

        def mk():
            k, v = rnd(b, HKV, t, D), rnd(b, HKV, t, D)
            return (
                K.turbo_quantize(k[:, :, :tq], bits),
                K.turbo_quantize(v[:, :, :tq], bits),
                k[:, :, tq:].clone(),
                v[:, :, tq:].clone(),
            )

        return mk, lambda q, s: K.turbo_decode_attention(q, *s[0], *s[1], bits=bits, k_tail=s[2], v_tail=s[3])
    if name == "drop4x":

        def mk():
            idx = torch.rand(b, HKV, t, generator=g).argsort(-1)[..., : t // 4].sort(-1).values
            return rnd(b, HKV, t, D), rnd(b, HKV, t, D), idx

        return mk, lambda q, s: K.gathered_attention(q, *s)
    if name in ("full_fused", "full_f16", "drop4x_f16"):
        dt, n = (torch.float32, t) if name == "full_fused" else (torch.float16, t // 4 if name[0] == "d" else t)
        return (lambda: (rnd(b, HKV, n, D).to(dt), rnd(b, HKV, n, D).to(dt)), lambda q, s: K.cache_attention(q, *s))
    if name == "drop4x_c":
        return (lambda: (rnd(b, HKV, t // 4, D), rnd(b, HKV, t // 4, D)), lambda q, s: K.verify_attention(q, *s))
    raise ValueError(f"unknown variant {name!r}")


def setup_variant(name, b, t, mem_mb, g) -> dict:
    make, step = make_variant(name, b, t, g)
    first = make()
    per_layer = _nbytes(first)
    # the bytes a step must read: the stored bytes (drop4x reads only the kept rows of its full K/V)
    read = per_layer if name != "drop4x" else _nbytes(first[2]) + 2 * b * HKV * (t // 4) * D * 4
    n_distinct = max(2, min(LAYERS, (mem_mb << 20) // max(1, per_layer)))
    states = [first] + [make() for _ in range(n_distinct - 1)]
    return {"name": name, "step": step, "states": states, "per_layer": per_layer, "read": read}


def run_step(v, qs) -> float:
    t0 = time.perf_counter()
    for layer in range(LAYERS):
        v["step"](qs[layer], v["states"][layer % len(v["states"])])
    return time.perf_counter() - t0


def time_setting(names, b, t, steps, mem_mb, seed=0) -> list[dict]:
    """Variants are set up together and timed round-robin, one step each per round, so that load
    from other processes on a shared machine hits every variant alike (the ratios stay fair)."""
    g = torch.Generator().manual_seed(seed)
    vs = [setup_variant(n, b, t, mem_mb, g) for n in names]
    qs = [torch.randn(b, HQ, 1, D, generator=g) for _ in range(LAYERS)]
    times = {v["name"]: [] for v in vs}
    for rnd in range(steps + 1):  # round 0 is the warm-up
        for v in vs:
            dt = run_step(v, qs)
            if rnd:
                times[v["name"]].append(dt)
    return [
        {
            "variant": v["name"],
            "batch": b,
            "context": t,
            "step_ms": 1e3 * statistics.median(times[v["name"]]),
            "step_ms_min": 1e3 * min(times[v["name"]]),
            "layer_bytes_stored": v["per_layer"],
            "layer_bytes_read": v["read"],
            "distinct_layers": len(v["states"]),
        }
        for v in vs
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["full", "kivi4", "kivi2", "turbo4", "drop4x", "drop4x_c", "full_fused", "full_f16", "drop4x_f16"],
    )
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (shared machine: keep low)")
    ap.add_argument("--mem-mb", type=int, default=256, help="cache memory per variant before cycling layers")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for t in args.contexts:
        for b in args.batches:
            res = time_setting(args.variants, b, t, args.steps, args.mem_mb)
            base = next((r["step_ms"] for r in res if r["variant"] == "full"), None)
            for r in res:
                r["ratio_vs_full"] = r["step_ms"] / base if base else None
                rows.append(r)
                if not args.json:
                    ratio = f"{r['ratio_vs_full']:.2f}" if r["ratio_vs_full"] is not None else "-"
                    print(
                        f"T={t:5d} B={b} {r['variant']:9s} {r['step_ms']:9.1f} ms/step  ratio {ratio:>5}  "
                        f"stored {r['layer_bytes_stored'] / 2**20:7.2f} MiB/layer",
                        flush=True,
                    )
    doc = {
        "device": "cpu",
        "threads": args.threads,
        "torch": torch.__version__,
        "layers": LAYERS,
        "hq": HQ,
        "hkv": HKV,
        "head_dim": D,
        "rows": rows,
    }
    if args.json:
        print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
