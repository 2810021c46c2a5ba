"""Every GPU check of the serving engine in one call (issues 24, 27): the Triton packed paged-attention kernels
against their torch references at big shapes (timed, with the bytes they read), then full KV vs VeriCache under
an HBM budget with real pinned-memory reloads, for a token-dropping drafter (complement reloads, bf16 draft pool)
and a quantizer whose codes stay packed in HBM (kivi4), with the mean draft / verify / decode step times.

A Llama-3-8B-shaped model with RANDOM bf16 weights (no weights can travel to the GPU machine), prompts of random
token ids at 32k-128k tokens, the same ServingEngine as on the CPU (vericache_connector/engine/serving.py): the
compressed KV in HBM, the full KV in pinned host memory reloaded over PCIe (cudaMemcpyAsync on a side stream,
an event per layer) for each verification. Random weights draft nonsense, so acceptance is REPLAYED: each
verification accepts what the real model accepted in the matching round of a trace measured on the CPU
(results/acceptance/<stamp>/traces.json, or a serving run's per-round counts; the source is printed). Outputs are
therefore not meaningful and not checked here; exactness is checked on the CPU with the real model. Each
VeriCache row carries the capacity model's prediction for it (engine/capacity.for_trace on the GPU's data-sheet
figures, benchmarks/capacity_model.GPUS, with the replayed rows' acceptance); the planner and the guard are off, so
the rows measure VeriCache itself. The budget is a fraction of the trace's full KV, and at least one request's
full KV (so that full KV serves it too). Each row is printed as a JSON line on stderr as soon as it is measured.

    python3 benchmarks/gpu_serving.py --json                      # on the GPU (~5 min; the machine's own python3)
    python benchmarks/gpu_serving.py --smoke --json               # a tiny dry run on the CPU (tests do this)

Exit code 0 when every kernel case matched its reference and every run finished, 1 otherwise, 2 without CUDA.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file (python benchmarks/<script>.py): import from the repository root, as -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import dataclasses
import gc
import glob
import json
import math
import time

from benchmarks.kit import paths

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
    p.add_argument(
        "--budget", type=float, default=0.25, help="fraction of the trace's full-KV demand (at least one request's)"
    )
    p.add_argument(
        "--compressors",
        nargs="+",
        default=["snapkv-4x", "kivi4"],
        help="VeriCache drafters (token dropping runs with a bf16 draft pool: complement reloads)",
    )
    p.add_argument("--skip-kernels", action="store_true", help="only the serving runs")
    p.add_argument("--k-max", type=int, default=64)
    p.add_argument("--link-gbps", type=float, default=None, help="cap the PCIe rate (default: the hardware's)")
    p.add_argument("--traces", default=None, help="acceptance traces (default: the newest results/acceptance)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if len(args.requests) != len(args.contexts):
        p.error("give one --requests count per --contexts value")
    return args


def load_rounds(path: str | None, compressor: str | None = None) -> dict:
    """Per-round accepted counts recorded on the CPU: {"source": ..., "rounds": [[n, ...] per recorded request]},
    of this compressor where the recording names it."""
    root = paths.ROOT / "results"
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
                runs = [r for r in doc["runs"] if compressor in (None, r.get("name"))]
                best = max((r.get("k", 0) for r in runs), default=0)  # the longest horizon recorded
                rounds = [r["accepted"] for r in runs if r.get("accepted") and r.get("k", 0) == best]
            else:  # serving.py: the VeriCache rows' per-request rounds (each at the horizon the planner chose)
                if compressor not in (None, doc.get("args", {}).get("compressor")):
                    continue
                rounds = [a for r in doc["rows"] for a in r.get("accepted_per_request", {}).values() if a]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if rounds:
            return {"source": f"{f} ({len(rounds)} recorded sequences of rounds)", "rounds": rounds}
    return FALLBACK if compressor is None else load_rounds(path, None)


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


def row_alphas(rounds: list[list[int]], n: int) -> list[float]:
    """The per-draft acceptance of the n requests' replayed rounds (Replay's order), each round taken as cut short."""
    seqs = [rounds[i % len(rounds)] for i in range(n)]
    return [min(0.999, sum(r) / (sum(r) + len(r))) for r in seqs]


def gpu_figures(device: str):
    """The capacity model's figures for this GPU (capacity_model.GPUS by name; an H200's for a CPU dry run)."""
    from benchmarks.capacity_model import GPUS

    name = __import__("torch").cuda.get_device_name() if device == "cuda" else "H200"
    return next((hw for key, hw in GPUS.items() if key.split()[0] in name), GPUS["H200"])


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


KERNEL_FORMATS = {"kivi4": ("kivi", 4, 4, 32, 16), "kivi2": ("kivi", 2, 2, 32, 16), "int8": ("int8",), "fp8": ("fp8",)}


def kernel_checks(smoke: bool, device: str) -> list[dict]:
    """packed_paged_attention (Triton on CUDA; the fused C++ kernel in a CPU dry run) against the torch reference
    on ragged rows, timed: Llama-3-8B heads (32 query, 8 KV, 128 dims), 8 rows of 2k-32k packed tokens plus a
    bf16 tail of 1-200 entries with 1-4 queries."""
    import torch

    import vericache_kernels.paged_packed as PP

    backend = "triton" if device == "cuda" else "cpp"
    if smoke:
        shape, prefix, tail, q = (4, 2, 32), [0, 300, 129, 700], [3, 1, 40, 9], [1, 2, 1, 3]
    else:
        shape = (32, 8, 128)
        prefix = [32768, 2048, 16384, 32000, 8191, 32768, 4096, 20000]
        tail, q = [200, 1, 64, 129, 33, 7, 90, 150], [1, 1, 4, 2, 1, 3, 1, 1]
    rows = []
    for name, fmt in KERNEL_FORMATS.items():
        case = f"packed {name} rows={len(prefix)} max_prefix={max(prefix)}"
        try:
            args = PP.random_packed_case(
                PP.PackedFormat(*fmt), prefix, tail, q, *shape, tail_dtype=torch.bfloat16, device=device, seed=7
            )
            ref = PP.packed_paged_attention_ref(*args)
            out = PP.packed_paged_attention(*args, backend=backend)
            err = float((out.float() - ref.float()).abs().max()) / max(1.0, float(ref.abs().max()))
            ms = _time(lambda: PP.packed_paged_attention(*args, backend=backend), device)
            nbytes = sum(x.nbytes for x in args[3].values()) * max(prefix) // max(1, args[3]["v"].shape[0] * 128)
            moved = _read_bytes(args)
            rows.append(
                dict(case=case, backend=backend, max_rel_err=err, ok=err < 2e-2, ms=ms, gb_per_s=moved / ms / 1e6)
            )
            del nbytes
        except Exception as e:  # one failing case never stops the others
            rows.append(dict(case=case, backend=backend, ok=False, error=f"{type(e).__name__}: {e}"[:500]))
        print(f"kernel {rows[-1]}", file=sys.stderr)
    return rows


def _read_bytes(args) -> int:
    """Bytes one call must read: each row's packed blocks and its tail entries."""
    cache, plen, tail_k, tlen = args[3], args[4], args[6], args[8]
    bs = cache["v"].shape[2]
    per_token = sum(x[0].nbytes for x in cache.values()) / bs
    return int(per_token * float(plen.sum()) + tail_k[0].nbytes * 2 / tail_k.shape[-1] * float(tlen.sum()))


def _time(fn, device: str, reps: int = 20) -> float:
    """Milliseconds per call (CUDA events after warm-up; wall clock on the CPU)."""
    import torch

    for _ in range(3):
        fn()
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps
    t = time.perf_counter()
    for _ in range(3):
        fn()
    return (time.perf_counter() - t) / 3 * 1e3


def step_times(split) -> dict:
    """Mean seconds of a step by kind (TimeSplit: verify steps have at least one verifying row)."""
    draft_or_decode = split.steps - split.verify_steps
    busy = split.draft_step_s + split.decode_step_s
    return {
        "mean_step_ms": 1e3 * (busy + split.verify_step_s) / max(1, split.steps),
        "mean_draft_or_decode_step_ms": 1e3 * busy / max(1, draft_or_decode),
        "mean_verify_step_ms": 1e3 * split.verify_step_s / max(1, split.verify_steps),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    paths.setup()
    import torch

    from vericache_connector.engine import capacity
    from vericache_connector.engine.config import ServingConfig
    from vericache_connector.engine.sequence import Request
    from vericache_connector.engine.serving import ServingEngine

    if not args.smoke and not torch.cuda.is_available():
        print("gpu_serving: no CUDA device (use --smoke for a CPU dry run)", file=sys.stderr)
        return 2
    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    draft_dtype = "float32" if args.smoke else "bfloat16"  # the model's dtype: token droppers reload the complement
    contexts = [512] if args.smoke else args.contexts
    counts = [4] if args.smoke else args.requests
    budget = 0.5 if args.smoke else args.budget
    t0 = time.perf_counter()
    kernels = [] if args.skip_kernels else kernel_checks(args.smoke, device)
    model = build(args.smoke, device, dtype)
    mc = model.cfg
    per_token = mc.kv_bytes_per_token(model.dtype.itemsize)
    warm = [Request(f"w{i}", list(range(1, 300)), 4) for i in range(2)]  # imports, kernels, allocator
    for policy, comp in [("full", None)] + [("vericache", c) for c in args.compressors]:
        cfg = ServingConfig(policy=policy, compressor=comp or "snapkv-4x", k_max=8, draft_dtype=draft_dtype)
        ServingEngine(model, cfg).run(warm)
    rows, sources = [], {}
    hw = gpu_figures(device)
    if args.link_gbps is not None:
        hw = dataclasses.replace(hw, link_bytes_per_s=args.link_gbps * 1e9)
    for ctx, n in zip(contexts, counts):
        g = torch.Generator().manual_seed(ctx)
        prompts = [torch.randint(0, mc.vocab_size, (ctx,), generator=g).tolist() for _ in range(n)]
        new = 8 if args.smoke else args.new
        demand = sum((len(p) + new) * per_token for p in prompts)
        one = (ctx + new + 1 + 128) * per_token  # one request's full KV, block-rounded up
        for policy, comp in [("full", None)] + [("vericache", c) for c in args.compressors]:
            cfg = ServingConfig(
                policy=policy,
                budget_bytes=int(max(budget * demand, one)),
                compressor=comp or "snapkv-4x",
                k_max=args.k_max,
                obs_window=32,
                draft_dtype=draft_dtype,
                link_bytes_per_s=None if args.link_gbps is None else args.link_gbps * 1e9,
                planner=False,
                guard=False,
            )
            replay = load_rounds(args.traces, comp) if comp else {"source": "-", "rounds": [[0]]}
            sources[comp or "full"] = replay["source"]
            reqs = [Request(f"c{ctx}-{i}", p, new) for i, p in enumerate(prompts)]
            if device == "cuda":
                gc.collect()
                torch.cuda.empty_cache()  # the last run's pools: each run sizes its own
                torch.cuda.synchronize()
            engine = ServingEngine(model, cfg)
            try:
                rep = engine.run(reqs, acceptance=Replay(replay["rounds"]))
            except Exception as e:  # one failing run (out of memory, say) never stops the others
                rows.append(dict(policy=policy, compressor=comp, context=ctx, error=f"{type(e).__name__}: {e}"[:500]))
                print(json.dumps(rows[-1]), file=sys.stderr)
                continue
            row = {k: v for k, v in rep.summary().items() if k != "split"}
            row.update(vars(rep.split), policy=policy, compressor=comp, context=ctx, requests=n, demand_bytes=demand)
            row.update(
                step_times(rep.split), draft_layout="packed" if engine.packed else "paged", complement=engine.complement
            )
            if comp:  # the capacity model for this run, on the GPU's figures and the replayed acceptance
                pred = capacity.for_trace(engine, reqs, row_alphas(replay["rounds"], n), hw)
                row.update(
                    model_hardware=hw.name,
                    predicted_speedup=pred.speedup,
                    predicted_vc_tokens_per_s=pred.vc_tokens_per_s,
                    predicted_full_tokens_per_s=pred.full_tokens_per_s,
                )
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if not isinstance(v, (dict, list))}), file=sys.stderr)
            print(
                f"ctx {ctx} {policy} {comp or ''}: {rep.tokens_per_s:.1f} tok/s, {rep.verifications} verifications, "
                f"link {rep.link_utilization:.0%}, peak {rep.peak_resident_bytes / 2**30:.2f} GiB, "
                f"steps {row['mean_draft_or_decode_step_ms']:.1f} / verify {row['mean_verify_step_ms']:.1f} ms",
                file=sys.stderr,
            )
    for r in rows:
        base = next(
            (b for b in rows if b["context"] == r["context"] and b["policy"] == "full" and "error" not in b), None
        )
        ok = base is not None and "error" not in r
        r["ratio_vs_full"] = r["tokens_per_s"] / base["tokens_per_s"] if ok else None
    doc = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)",
        "model_hardware": vars(hw),
        "kernels": kernels,
        "kernels_ok": all(k["ok"] for k in kernels),
        "acceptance": sources,
        "model": "Llama-3-8B shape, random bf16 weights" if not args.smoke else "tiny random model",
        "budget_fraction": budget,
        "rows": rows,
        "seconds": time.perf_counter() - t0,
        "note": "acceptance replayed from CPU traces; outputs not meaningful (random weights)",
    }
    if args.json:
        print(json.dumps(doc, indent=2, default=str))
    else:
        for k in kernels:
            print(f"{k['case']:>40} {'ok' if k['ok'] else 'FAILED'} {k.get('ms', float('nan')):8.3f} ms")
        for r in rows:
            if "error" in r:
                print(f"{r['context']:>7} {r['policy']:>9} {r['compressor'] or '':>10} {r['error']}")
                continue
            pred = f"  (model {r['predicted_speedup']:.2f}x)" if "predicted_speedup" in r else ""
            print(
                f"{r['context']:>7} {r['policy']:>9} {r['compressor'] or '':>10} {r['tokens_per_s']:8.1f} tok/s  "
                f"x{r['ratio_vs_full']:.2f}{pred}"
            )
    ok = doc["kernels_ok"] and all("error" not in r and math.isfinite(r["tokens_per_s"]) for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
