"""The serving scheduler on a GPU, in one call: full KV vs VeriCache under an HBM budget, real pinned-memory reloads.

A Llama-3-8B-shaped model with RANDOM bf16 weights (no weights can travel to the GPU machine), prompts of random
token ids at 32k-128k tokens, the same ServingEngine as on the CPU (vericache_connector/engine/serving.py): the
compressed KV in HBM, the full KV in pinned host memory reloaded over PCIe (cudaMemcpyAsync on a side stream,
an event per layer) for each verification. Random weights draft nonsense, so acceptance is REPLAYED: each
verification accepts what the real model accepted in the matching round of a trace measured on the CPU
(results/acceptance/<stamp>/traces.json, or a serving run's per-round counts; the source is printed). Outputs are
therefore not meaningful and not checked here; exactness is checked on the CPU with the real model.

    python benchmarks/gpu_serving.py --json                       # on the GPU (~5 min)
    python benchmarks/gpu_serving.py --smoke --json               # a tiny dry run on the CPU (tests do this)
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import sys
import time

import bench_paths

BIG = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=500000.0,
    max_position=131072 + 4096,
)
TINY = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    rope_theta=10000.0,
    max_position=8192,
)
# Used when no trace file is found: SmolLM2-135M, snapkv-4x, per-round accepted drafts at k=16 (a stand-in, stated)
FALLBACK = {"source": "built-in stand-in: accepted 9 of 16 drafts per round", "rounds": [[9, 12, 7, 16, 5, 10]]}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU (a dry run of this script)")
    p.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--requests", type=int, nargs="+", default=[8, 3], help="requests per context (same order)")
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--budget", type=float, default=0.25, help="fraction of the trace's full-KV demand")
    p.add_argument("--compressor", default="snapkv-4x")
    p.add_argument("--k-max", type=int, default=64)
    p.add_argument("--link-gbps", type=float, default=None, help="cap the PCIe rate (default: the hardware's)")
    p.add_argument("--traces", default=None, help="acceptance traces (default: the newest results/acceptance)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if len(args.requests) != len(args.contexts):
        p.error("give one --requests count per --contexts value")
    return args


def load_rounds(path: str | None) -> dict:
    """Per-round accepted counts recorded on the CPU: {"source": ..., "rounds": [[n, ...] per recorded request]}."""
    root = bench_paths.ROOT / "results"
    files = (
        [path]
        if path
        else (
            sorted(glob.glob(str(root / "serving/*/results.json")))
            + sorted(glob.glob(str(root / "acceptance/*/traces.json")))
        )
    )
    for f in reversed(files):
        try:
            doc = json.loads(open(f).read())
            if "runs" in doc:  # acceptance.py traces: one list of accepted counts per (compressor, k, prompt)
                rounds = [r["accepted"] for r in doc["runs"] if r.get("accepted")]
            else:  # serving.py: the VeriCache rows' per-request rounds (each at the horizon the planner chose)
                rounds = [a for r in doc["rows"] for a in r.get("accepted_per_request", {}).values() if a]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if rounds:
            return {"source": f"{f} ({len(rounds)} recorded sequences of rounds)", "rounds": rounds}
    return FALLBACK


class Replay:
    """acceptance(seq, k): the next recorded round of this request's trace, capped by what was drafted."""

    def __init__(self, rounds: list[list[int]]):
        self.rounds, self.at, self.which = rounds, {}, {}

    def __call__(self, seq, k: int) -> int:
        rid = seq.request_id
        trace = self.rounds[self.which.setdefault(rid, len(self.which) % len(self.rounds))]
        i = self.at.get(rid, 0)
        self.at[rid] = i + 1
        return min(k, trace[i % len(trace)])


def build(smoke: bool, device: str, dtype):
    import torch

    from vericache_connector.model.causal_lm import CausalLM, ModelConfig

    shape = TINY if smoke else BIG
    cfg = ModelConfig(
        model_type="llama",
        rms_norm_eps=1e-5,
        rope_scaling=None,
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=False,
        eos_token_ids=(),
        **shape,
    )
    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to_empty(device=device).to(dtype)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=g)
    from vericache_connector.model.causal_lm import rope_inv_freq

    model.inv_freq = rope_inv_freq(cfg).to(device)
    return model.eval()


def main(argv=None) -> int:
    args = parse_args(argv)
    bench_paths.setup()
    import torch

    from vericache_connector.engine.config import ServingConfig
    from vericache_connector.engine.sequence import Request
    from vericache_connector.engine.serving import ServingEngine

    if not args.smoke and not torch.cuda.is_available():
        print("gpu_serving: no CUDA device (use --smoke for a CPU dry run)", file=sys.stderr)
        return 2
    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    contexts = [512] if args.smoke else args.contexts
    counts = [4] if args.smoke else args.requests
    budget = 0.5 if args.smoke else args.budget
    t0 = time.perf_counter()
    model = build(args.smoke, device, dtype)
    replay = load_rounds(args.traces)
    mc = model.cfg
    per_token = mc.kv_bytes_per_token(model.dtype.itemsize)
    warm = [Request(f"w{i}", list(range(1, 300)), 4) for i in range(2)]  # imports, kernels, allocator
    for policy in ("full", "vericache"):
        ServingEngine(model, ServingConfig(policy=policy, compressor=args.compressor, k_max=8)).run(warm)
    rows = []
    for ctx, n in zip(contexts, counts):
        g = torch.Generator().manual_seed(ctx)
        prompts = [torch.randint(0, mc.vocab_size, (ctx,), generator=g).tolist() for _ in range(n)]
        new = 8 if args.smoke else args.new
        demand = sum((len(p) + new) * per_token for p in prompts)
        for policy in ("full", "vericache"):
            cfg = ServingConfig(
                policy=policy,
                budget_bytes=int(budget * demand),
                compressor=args.compressor,
                k_max=args.k_max,
                obs_window=32,
                link_bytes_per_s=None if args.link_gbps is None else args.link_gbps * 1e9,
            )
            reqs = [Request(f"c{ctx}-{i}", p, new) for i, p in enumerate(prompts)]
            if device == "cuda":
                torch.cuda.synchronize()
            rep = ServingEngine(model, cfg).run(reqs, acceptance=Replay(replay["rounds"]))
            row = {k: v for k, v in rep.summary().items() if k != "split"}
            row.update(vars(rep.split), policy=policy, context=ctx, requests=n, demand_bytes=demand)
            rows.append(row)
            print(
                f"ctx {ctx} {policy}: {rep.tokens_per_s:.1f} tok/s, {rep.verifications} verifications, "
                f"link {rep.link_utilization:.0%}, peak {rep.peak_resident_bytes / 2**30:.2f} GiB",
                file=sys.stderr,
            )
    for r in rows:
        base = next(b for b in rows if b["context"] == r["context"] and b["policy"] == "full")
        r["ratio_vs_full"] = r["tokens_per_s"] / base["tokens_per_s"]
    doc = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)",
        "acceptance": replay["source"],
        "model": "Llama-3-8B shape, random bf16 weights" if not args.smoke else "tiny random model",
        "budget_fraction": budget,
        "rows": rows,
        "seconds": time.perf_counter() - t0,
        "note": "acceptance replayed from CPU traces; outputs not meaningful (random weights)",
    }
    if args.json:
        print(json.dumps(doc, indent=2, default=str))
    else:
        for r in rows:
            print(f"{r['context']:>7} {r['policy']:>9} {r['tokens_per_s']:8.1f} tok/s  x{r['ratio_vs_full']:.2f}")
    return 0 if all(math.isfinite(r["tokens_per_s"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
