"""GPU decode step times: full-KV step vs draft step on a compressed cache vs one verify pass.

The model is Llama-3-8B-shaped (hidden 4096, 32 query / 8 KV heads, head_dim 128, MLP 14336) with random
bf16 weights and `--layers` layers (the step time scales per layer; the ratios are what matter). Caches
are filled with random KV (no prefill needed for timing). Per (context, batch) it times:
  full      one decode step over the full KV                (what plain decoding pays per token)
  drop4x    one draft step over a 4x token-dropped cache    (StreamingLLM/SnapKV/TOVA/knorm drafts)
  verify    one pass of k+1 tokens over the full KV         (VeriCache pays it once per round)
and predicts VeriCache's decode speedup for an acceptance a at horizon k:
  tokens per round = a + 1;  round time = k * drop4x + verify;  speedup = (a + 1) * full / round time.
`--smoke` runs a tiny config on the CPU (used by the test suite so the script cannot rot).

    python benchmarks/gpu_step_time.py --json            # on a GPU (one device call with gpu_check.sh)
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file (python benchmarks/<script>.py): import from the repository root, as -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import time

import torch

from benchmarks.kit import paths


def build(layers: int, smoke: bool, device: str, dtype: torch.dtype):
    paths.setup()
    from vericache_connector.model.causal_lm import CausalLM, ModelConfig

    big = dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        max_position=131072,
    )
    tiny = dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        max_position=8192,
    )
    cfg = ModelConfig(
        model_type="llama",
        num_layers=layers,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=None,
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=False,
        eos_token_ids=(),
        **(tiny if smoke else big),
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = CausalLM(cfg).to(dtype)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return model.eval()


def timed(fn, device: str, reps: int) -> float:
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def step_times(model, ctx: int, batch: int, k: int, device: str, reps: int) -> dict:
    def cache_of(length: int):
        c = model.new_cache(batch, length + k + 2)
        for kk, vv in zip(c.keys, c.values):
            kk.normal_()
            vv.normal_()
        c.lengths[:] = length
        return c

    full, drop = cache_of(ctx), cache_of(ctx // 4)
    ids = torch.randint(0, model.cfg.vocab_size, (batch, k + 1), device=device)

    def run(cache, q):
        base = cache.lengths.clone()
        model(ids[:, :q], base[:, None] + torch.arange(q, device=device)[None], cache)
        cache.lengths = base

    return {
        "full_s": timed(lambda: run(full, 1), device, reps),
        "drop4x_s": timed(lambda: run(drop, 1), device, reps),
        "verify_s": timed(lambda: run(full, k + 1), device, reps),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--contexts", type=int, nargs="+", default=[16384, 65536])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--accepted", type=float, default=5.9, help="measured mean accepted drafts at k (snapkv-4x, k=8)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="tiny config on the CPU")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_step_time: no CUDA device here; use --smoke for the CPU check", file=sys.stderr)
        return 2
    model = build(args.layers, args.smoke, device, torch.float32 if args.smoke else torch.bfloat16)
    rows = []
    with torch.inference_mode():
        for ctx in args.contexts:
            for b in args.batches:
                r = {"context": ctx, "batch": b, "k": args.k, **step_times(model, ctx, b, args.k, device, args.reps)}
                r["draft_over_full"] = r["drop4x_s"] / r["full_s"]
                r["predicted_speedup"] = (args.accepted + 1) * r["full_s"] / (args.k * r["drop4x_s"] + r["verify_s"])
                rows.append(r)
    if args.json:
        print(json.dumps({"layers": args.layers, "accepted": args.accepted, "rows": rows}, indent=2))
    else:
        print("| context | batch | full ms | draft 4x ms | verify ms | draft/full | predicted speedup |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            print(
                f"| {r['context']} | {r['batch']} | {r['full_s'] * 1e3:.2f} | {r['drop4x_s'] * 1e3:.2f} | "
                f"{r['verify_s'] * 1e3:.2f} | {r['draft_over_full']:.2f} | {r['predicted_speedup']:.2f}x |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
