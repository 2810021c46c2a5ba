"""A roofline cost model: full-KV decoding vs VeriCache on big models and GPUs, from measured acceptance.

Decode on a GPU is memory bound, so a forward pass costs the bytes it reads / HBM bandwidth (or its FLOPs /
peak FLOP/s, whichever is larger):

    full step   = (W + B*T*kv) / HBM               plain decoding: weights + the full KV, once per token
    draft step  = (W + B*c*T*kv) / HBM             VeriCache drafts on the compressed KV (ratio c)
    verify step = (W + B*T*kv) / HBM               one pass over the full KV checks k drafts (k+1 tokens)
    VeriCache per token = (k * draft + verify) / (a + 1)     a = mean accepted drafts per verification

  W = weight bytes (params x 2, bf16), kv = KV bytes per token (layers x kv_heads x head_dim x 2 x 2, bf16),
  T = context tokens, B = batch (concurrent requests), c = compressed bytes / full bytes.

The prefix KV comes over a link (network or PCIe) at L bytes/s. Full-KV (what LMCache does today) waits
for the whole copy, then decodes:  e2e = B*T*kv/L + N * full_step, first token at B*T*kv/L + full_step.
VeriCache fetches the compressed copy first (c*B*T*kv/L), drafts while the full copy streams in (serially on
the same link, as RemotePrefixCache does), up to k_max drafts; the first verify runs once the full copy is in
and k1 = max(k, min(k_max, drafts that fit in the transfer)) drafts are made; it emits min(a(k1), k1) + 1 tokens; then steady rounds.
With --compressed-local (Workload.compressed_local_bytes_per_s) the compressed copy comes over its own path
(e.g. kept in host DRAM, PCIe 5) in parallel, so the full copy is not delayed by it.
Tensor parallelism (tp GPUs) divides W and the KV over tp HBMs. Suffix prefill and kernel launch overheads
are ignored (both designs pay them).

Compression ratios measured on the CPU float32 KV are rescaled for quantizers (kivi, int8, fp8, turboquant:
the same bits per element are worth twice as much against a bf16 KV: c_bf16 = min(1, c_fp32 * 4 / 2)); eviction
ratios (streamingllm, snapkv, tova, knorm) do not depend on the dtype.

    python benchmarks/cost_model.py                                   # built-in acceptance figures
    python benchmarks/cost_model.py --measured results/side_by_side/<stamp>/results.json
    python benchmarks/cost_model.py --measured results/acceptance/<stamp>/results.json --context 32768 --batch 1 16
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file (python benchmarks/<script>.py): import from the repository root, as -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import math
import statistics
from dataclasses import asdict, dataclass

from benchmarks.kit.report import markdown
from benchmarks.kit.results import Results, command_line

GBIT = 1e9 / 8


@dataclass(frozen=True)
class Hardware:
    name: str
    hbm_bytes_per_s: float  # per GPU
    flops: float  # dense bf16 FLOP/s per GPU
    hbm_bytes: float  # capacity per GPU


@dataclass(frozen=True)
class Model:
    name: str
    params: float
    layers: int
    kv_heads: int
    head_dim: int
    tp: int = 1  # GPUs the model is sharded over (tensor parallel)
    bytes_per_param: int = 2
    kv_bytes_per_elem: int = 2

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * self.kv_heads * self.head_dim * 2 * self.kv_bytes_per_elem


@dataclass(frozen=True)
class Link:
    name: str
    bytes_per_s: float


@dataclass(frozen=True)
class Drafting:
    """What was measured: the compressor, the draft horizon k, the mean accepted drafts per verification
    (at k, and optionally at k_max for the long first round), and the compressed/full byte ratio."""

    compressor: str
    k: int
    accepted: float
    compression: float
    k_max: int = 32
    accepted_at_k_max: float | None = None  # default: same acceptance RATE as at k, capped by k_max


@dataclass(frozen=True)
class Workload:
    context: int = 16384  # prefix tokens per request (all fetched)
    batch: int = 1
    new_tokens: int = 256
    compressed_local_bytes_per_s: float | None = None  # compressed copy on its own path (e.g. host DRAM
    # over PCIe), fetched in parallel with the full copy


HARDWARE = {
    "H100": Hardware("H100 SXM", 3.35e12, 989e12, 80e9),
    "H200": Hardware("H200", 4.8e12, 989e12, 141e9),
}
MODELS = {
    "llama3-8b": Model("Llama-3-8B", 8.03e9, 32, 8, 128),
    "qwen3-32b": Model("Qwen3-32B", 32.8e9, 64, 8, 128),
    "llama3.3-70b": Model("Llama-3.3-70B", 70.6e9, 80, 8, 128, tp=2),
}
LINKS = {
    "25GbE": Link("25 Gbit/s", 25 * GBIT),
    "100GbE": Link("100 Gbit/s", 100 * GBIT),
    "400GbE": Link("400 Gbit/s", 400 * GBIT),
    "PCIe5x16": Link("PCIe 5 x16", 64e9),
}
# Used when no --measured file is given: SmolLM2-135M, greedy, kivi4 and snapkv-4x (docs/benchmarks.md).
BUILTIN = [Drafting("kivi4", 8, 6.5, 0.181 * 2, 32, None), Drafting("snapkv-4x", 8, 5.0, 0.252, 32, None)]
QUANTIZERS = ("kivi", "int8", "fp8", "turboquant")


def pass_s(hw: Hardware, m: Model, kv_bytes: float, tokens: int) -> float:
    """One forward of `tokens` query tokens per request: max(bytes read / HBM, FLOPs / peak), over tp GPUs."""
    mem = (m.weight_bytes + kv_bytes) / (hw.hbm_bytes_per_s * m.tp)
    compute = 2 * m.params * tokens / (hw.flops * m.tp)
    return max(mem, compute)


@dataclass
class Prediction:
    model: str
    hardware: str
    link: str
    compressor: str
    k: int
    context: int
    batch: int
    fits: bool
    full_step_ms: float
    draft_step_ms: float
    verify_step_ms: float
    vc_token_ms: float
    decode_speedup: float
    transfer_full_s: float
    ttft_full_s: float
    ttft_vc_s: float
    e2e_full_s: float
    e2e_vc_s: float
    e2e_speedup: float


def accepted_at(d: Drafting, k: int) -> float:
    if k == d.k:
        return d.accepted
    if k == d.k_max and d.accepted_at_k_max is not None:
        return d.accepted_at_k_max
    return min(k, d.accepted / d.k * k)


def predict(hw: Hardware, m: Model, link: Link, d: Drafting, w: Workload) -> Prediction:
    kv_full = w.batch * w.context * m.kv_bytes_per_token
    full = pass_s(hw, m, kv_full, w.batch)
    draft = pass_s(hw, m, d.compression * kv_full, w.batch)
    verify = pass_s(hw, m, kv_full, w.batch * (d.k + 1))
    vc_tok = (d.k * draft + verify) / (min(d.accepted, d.k) + 1)  # at most k drafts can be accepted
    x_full = kv_full / link.bytes_per_s
    if w.compressed_local_bytes_per_s:  # separate path, in parallel: the full copy is not delayed
        x_comp = d.compression * kv_full / w.compressed_local_bytes_per_s
        full_in = x_full
    else:  # the implementation: same link, compressed copy first
        x_comp = d.compression * x_full
        full_in = x_comp + x_full
    # full-KV: wait for the whole copy, then N plain steps
    ttft_full, e2e_full = x_full + full, x_full + w.new_tokens * full
    # VeriCache: compressed copy, drafting overlapped with the full stream, first verify, steady rounds
    k1 = max(d.k, min(d.k_max, math.floor(max(0.0, full_in - x_comp) / draft)))
    verify1 = pass_s(hw, m, kv_full, w.batch * (k1 + 1))
    ttft_vc = max(x_comp + k1 * draft, full_in) + verify1
    tokens1 = min(k1, accepted_at(d, k1)) + 1
    e2e_vc = ttft_vc + max(0.0, w.new_tokens - tokens1) * vc_tok
    need = m.weight_bytes + kv_full * (1 + d.compression)
    return Prediction(
        m.name,
        hw.name,
        link.name,
        d.compressor,
        d.k,
        w.context,
        w.batch,
        need <= hw.hbm_bytes * m.tp,
        full * 1e3,
        draft * 1e3,
        verify * 1e3,
        vc_tok * 1e3,
        full / vc_tok,
        x_full,
        ttft_full,
        ttft_vc,
        e2e_full,
        e2e_vc,
        e2e_full / e2e_vc,
    )


def load_measured(path: Path, ks: list[int] | None = None) -> list[Drafting]:
    """Drafting figures from a results.json of side_by_side.py (vericache rows) or acceptance.py."""
    data = json.loads(Path(path).read_text())
    kv_elem = 4 if data.get("kv_bytes_per_token", 46080) == 46080 else 2  # CPU SmolLM2 runs are float32
    acc: dict = {}
    ratio: dict = {}
    for r in data["rows"]:
        if "mean_accepted" in r:  # acceptance.py
            comp, k, a = r["compressor"], str(r["k"]), r["mean_accepted"]
        elif r.get("method") == "vericache" and r.get("accepted") is not None:  # side_by_side.py
            comp, k = r["compressor"], str(r["k"])
            a = r["accepted_at_k"] if r.get("accepted_at_k") is not None else r["accepted"]
        else:
            continue
        if not k.isdigit():
            continue
        acc.setdefault((comp, int(k)), []).append(a)
        if r.get("bytes_ratio") is not None:
            ratio[comp] = r["bytes_ratio"]
    out = []
    for (comp, k), xs in sorted(acc.items()):
        if ks and k not in ks:
            continue
        c = ratio.get(comp, 1.0)
        if comp.startswith(QUANTIZERS):
            c = min(1.0, c * kv_elem / 2)
        at_max = acc.get((comp, 32))
        out.append(Drafting(comp, k, sum(xs) / len(xs), c, 32, sum(at_max) / len(at_max) if at_max else None))
    if not out:
        raise SystemExit(f"{path}: no acceptance rows found")
    return out


def table(preds: list[Prediction]) -> str:
    header = "model | GPU | link | compressor | k | ctx | B | fits | full ms/tok | draft ms | verify ms | VC ms/tok"
    header += " | **decode speedup** | full KV fetch s | TTFT full s | TTFT VC s | **e2e speedup**"
    rows = [
        [p.model, p.hardware, p.link, p.compressor, p.k, p.context, p.batch, "yes" if p.fits else "NO"]
        + [f"{p.full_step_ms:.2f}", f"{p.draft_step_ms:.2f}", f"{p.verify_step_ms:.2f}", f"{p.vc_token_ms:.2f}"]
        + [f"**{p.decode_speedup:.2f}x**", f"{p.transfer_full_s:.3f}", f"{p.ttft_full_s:.3f}", f"{p.ttft_vc_s:.3f}"]
        + [f"**{p.e2e_speedup:.2f}x**"]
        for p in preds
    ]
    return markdown(header.split(" | "), "llllrrrlrrrrrrrrr", rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--measured", type=Path, help="results.json of side_by_side.py or acceptance.py")
    p.add_argument("--ks", nargs="+", type=int, default=[8, 32], help="draft horizons to take from --measured")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--hardware", nargs="+", default=["H200"], choices=list(HARDWARE))
    p.add_argument("--links", nargs="+", default=["100GbE"], choices=list(LINKS))
    p.add_argument("--context", nargs="+", type=int, default=[16384, 131072])
    p.add_argument("--batch", nargs="+", type=int, default=[1, 16])
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument(
        "--compressed-local",
        choices=list(LINKS),
        default=None,
        help="the compressed copy comes over this separate path in parallel (default: same link)",
    )
    p.add_argument("--out", default="results/cost_model")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--serving",
        nargs="?",
        const="",
        default=None,
        help="the capacity model of long-context serving (capacity_model.py): the paper's table next to its "
        "prediction, then H200 / GH200 / L40S / RTX PRO 6000 with our measured acceptance per compressor; given "
        "a serving.py results.json, also checked against that CPU run",
    )
    p.add_argument("--acceptance", type=Path, default=None, help="--serving: acceptance.py results.json to fit a from")
    p.add_argument("--serving-context", nargs="+", type=int, default=[32768, 131072], help="--serving: contexts")
    args = p.parse_args(argv)
    if args.serving is not None:
        args.serving = Path(args.serving) if args.serving else None
        return serving_main(args, argv)
    local = LINKS[args.compressed_local].bytes_per_s if args.compressed_local else None
    drafts = load_measured(args.measured, args.ks) if args.measured else BUILTIN
    preds = [
        predict(HARDWARE[h], MODELS[m], LINKS[ln], d, Workload(t, b, args.new_tokens, local))
        for m in args.models
        for h in args.hardware
        for ln in args.links
        for d in drafts
        for t in args.context
        for b in args.batch
    ]
    cmd = command_line(argv)
    src = args.measured or "built-in figures"
    head = (
        f"Cost model (roofline, memory-bound decode; see benchmarks/cost_model.py). Acceptance and compression "
        f"from {src}; {args.new_tokens} new tokens; compressed copy "
        f"{'over ' + args.compressed_local + ' in parallel' if args.compressed_local else 'first, on the same link'}. Command: `{cmd}`"
    )
    text = head + "\n\n" + table(preds)
    out = Results.create(args.out, command=cmd)
    out.write({"command": cmd, "drafting": [asdict(d) for d in drafts], "rows": [asdict(x) for x in preds]}, text)
    print(json.dumps([asdict(x) for x in preds], indent=2) if args.json else text)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def measured_alphas(path: Path | None) -> tuple[str, dict[str, tuple[float, int, float]]]:
    """Per compressor (a, k, mean accepted) from acceptance.py's results.json (the newest under results/acceptance
    with horizons >= 32 when path is None): a fitted at the largest horizon measured (<= 64)."""
    from benchmarks.capacity_model import fit_alpha

    files = [path] if path else sorted(Path("results/acceptance").glob("*/results.json"), reverse=True)
    for f in files:
        try:
            rows = json.loads(Path(f).read_text())["rows"]
        except (OSError, ValueError, KeyError):
            continue
        best: dict = {}
        for r in rows:
            k, comp = r.get("k"), r.get("compressor")
            if isinstance(k, int) and 32 <= k <= 64 and comp and r.get("mean_accepted") is not None:
                if comp not in best or k > best[comp][1]:
                    best[comp] = (fit_alpha(k, r["mean_accepted"]), k, r["mean_accepted"])
        if best:
            return str(f), best
    return "none found", {}


SERVED = ["kivi4", "kivi2", "int8", "fp8", "snapkv-4x", "snapkv-8x", "kvzip-5x", "expected-attention-4x", "adakv-ea-4x"]


def serving_main(args, argv) -> int:
    """The capacity model (engine/capacity.py, capacity_model.py): the paper's table next to its prediction, the
    GPUs with our measured acceptance per compressor, and (given a serving.py results.json) a check against
    that CPU run."""
    from benchmarks import capacity_model as cap

    cmd = command_line(argv)
    paper, paper_preds = cap.paper_rows()
    lines = [
        f"Capacity model (vericache_connector/engine/capacity.py). Command: `{cmd}`",
        "",
        f"The paper: Llama-3.1-70B on {cap.PAPER['devices']} x H100 NVL (TP {cap.PAPER['devices']}, PCIe 5 "
        f"{cap.PCIE_EFF:g} effective), {cap.PAPER['context']}-token contexts, a = {cap.PAPER['alpha']} per draft "
        "(23 of 30 accepted); budget = the compressed KV's share of the full KV:",
        "",
        "| budget | paper full tok/s | predicted | error | paper VeriCache / full | predicted | error |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in paper:
        lines.append(
            f"| {r['budget']:g} | {r['paper_full_tokens_per_s']:.0f} | {r['predicted_full_tokens_per_s']:.0f} | "
            f"{r['full_error']:+.0%} | {r['paper_speedup']:.2f}x | {r['predicted_speedup']:.2f}x | "
            f"{r['speedup_error']:+.0%} |"
        )
    full_ok = all(abs(r["full_error"]) <= 0.15 for r in paper)
    vc_ok = all(abs(r["speedup_error"]) <= 0.35 for r in paper)
    lines += [
        "",
        f"full-KV prediction within 15% of the paper: {'yes' if full_ok else 'NO'}; VeriCache within 35%: "
        f"{'yes' if vc_ok else 'NO'}",
        "",
        cap.serving_table(paper_preds),
    ]
    source, alphas = measured_alphas(args.acceptance)
    m = cap.MODELS["llama3-8b"]
    gpus = []
    for name in ("H200", "GH200", "L40S", "RTX PRO 6000"):
        hw = cap.GPUS[name]
        for spec in [s for s in SERVED if s in alphas]:
            c, r = cap.resident_fraction(spec)
            for t in args.serving_context:
                p = cap.predict(hw, m, t, cap.budget_of(hw, m), c, alphas[spec][0], k_max=64, reload_fraction=r)
                p.compressor = spec
                gpus.append(p)
    lines += [
        "",
        f"Llama-3-8B bf16 on one GPU (90% of its memory for weights + KV), our measured acceptance per compressor "
        f"(a fitted to the accepted drafts at the longest horizon measured, SmolLM2-135M on the CPU: {source}); "
        "c, r as the serving engine holds the compressed KV (quantizers packed; token dropping with complement "
        "reloads):",
        "",
        cap.serving_table(gpus) if gpus else "(no acceptance measurements found: run benchmarks/acceptance.py)",
    ]
    checks, h200 = [], []
    if args.serving:
        checks, h200, text = cpu_check(args.serving)
        lines += ["", text]
    text = "\n".join(lines)
    out = Results.create(args.out, command=cmd)
    doc = {
        "command": cmd,
        "paper": paper,
        "paper_within_bounds": {"full_15pct": full_ok, "vericache_35pct": vc_ok},
        "acceptance_source": source,
        "alphas": {k: {"alpha": a, "k": kk, "accepted": acc} for k, (a, kk, acc) in alphas.items()},
        "gpus": [cap.as_dict(p) for p in gpus],
        "checks": checks,
        "summary": [cap.as_dict(p) for p in h200],
    }
    out.write(doc, text)
    print(json.dumps(doc, indent=2) if args.json else text)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def cpu_check(path: Path) -> tuple[list[dict], list, str]:
    """The capacity model checked against a CPU serving run, then applied to the H200 with its acceptance."""
    from benchmarks.capacity_model import predict_serving, serving_table

    run = json.loads(Path(path).read_text())
    rows = [r for r in run["rows"] if r["sweep"] == "budget"]
    a = run["args"]
    ctx = sum(run["prompt_tokens"]) / len(run["prompt_tokens"])
    cpu_model = Model("SmolLM2-135M fp32 (CPU)", 134.5e6, 30, 3, 64, bytes_per_param=4, kv_bytes_per_elem=4)
    checks = []
    for full in (r for r in rows if r["policy"] == "full"):
        vc = next(
            (r for r in rows if r["policy"] == "vericache" and r["budget_fraction"] == full["budget_fraction"]), None
        )
        if vc is None or not full["steps"]:
            continue
        # the CPU's effective bandwidth, from the full-KV run's own steps (its rows x context read per step)
        step_f = full["decode_step_s"] / full["steps"]
        rows_f = max(1, full["max_concurrent"])
        bw = (cpu_model.weight_bytes + rows_f * ctx * cpu_model.kv_bytes_per_token) / step_f
        # and its compute rate, from VeriCache's drafting steps (one token per resident row): on a CPU thread a
        # forward's cost grows with its tokens, which a bandwidth-only roofline would miss
        draft_steps = vc["steps"] - vc["verify_steps"]
        rows_v = max(1, vc["max_concurrent"])
        flops = 2 * cpu_model.params * rows_v / (vc["draft_step_s"] / draft_steps) if draft_steps else 1e18
        hw = Hardware("CPU (calibrated)", bw, flops, 0)
        # per-draft acceptance a from the accepted drafts per round m: a geometric round (accept each draft with
        # probability a until the first rejection) has mean a / (1 - a), so a = m / (1 + m); rounds cut short by
        # their horizon make this an underestimate
        alpha = vc["mean_accepted"] / (1 + vc["mean_accepted"])
        budget = full["budget_fraction"] * run["demand_bytes"]
        pred = predict_serving(
            hw,
            cpu_model,
            a["link_gbps"] * 1e9,
            int(ctx),
            budget,
            compression_of(a["compressor"], 0.5),
            alpha,
            k_max=a["k_max"],
            max_rows=len(run["prompt_tokens"]),  # the trace has no more requests than that
        )
        checks.append(
            {
                "budget_fraction": full["budget_fraction"],
                "measured_speedup": vc["tokens_per_s"] / full["tokens_per_s"],
                "predicted_speedup": pred.speedup,
                "measured_full_rows": rows_f,
                "predicted_full_rows": pred.full_rows,
                "measured_vc_rows": vc["max_concurrent"],
                "predicted_vc_rows": pred.vc_rows,
                "alpha": alpha,
                "cpu_bytes_per_s": bw,
                "cpu_flops": flops,
            }
        )
    alpha = statistics.fmean(c["alpha"] for c in checks) if checks else 0.8
    comp = compression_of(a["compressor"], 1.0)
    h200 = HARDWARE["H200"]
    preds = [
        predict_serving(
            h200,
            MODELS["llama3-8b"],
            link,
            t,
            0.9 * h200.hbm_bytes - MODELS["llama3-8b"].weight_bytes,
            comp,
            alpha,
            k_max=a["k_max"],
        )
        for link in (64e9, 450e9)
        for t in (32768, 131072)
    ]
    lines = [
        f"Capacity model checked against {path} (CPU, link emulated at {a['link_gbps']} GB/s):",
        "",
        "| budget | measured VC/full | predicted | rows full measured/predicted | rows VC measured/predicted | a |",
        "|---:|---:|---:|---|---|---:|",
    ]
    for c in checks:
        lines.append(
            f"| {c['budget_fraction']:g} | {c['measured_speedup']:.2f} | {c['predicted_speedup']:.2f} | "
            f"{c['measured_full_rows']}/{c['predicted_full_rows']} | {c['measured_vc_rows']}/"
            f"{c['predicted_vc_rows']} | {c['alpha']:.2f} |"
        )
    lines += [
        "",
        f"H200 (141 GB, 90% for weights + KV), Llama-3-8B bf16, {a['compressor']} (c = {comp:.3f}), that run's "
        f"acceptance (a = {alpha:.2f}); nominal PCIe 5 x16 = 64 GB/s and GH200 C2C = 450 GB/s:",
        "",
        serving_table(preds),
    ]
    return checks, preds, "\n".join(lines)


def compression_of(spec: str, draft_over_full: float) -> float:
    """Resident bytes of the compressed KV / full bytes as the serving engine holds it (capacity_model.
    resident_fraction): quantizers' packed codes and scales against the full KV's element size (CPU float32 when
    draft_over_full < 1, else bf16); token dropping's kept fraction times draft / full bytes per element (CPU: a
    float16 draft pool against float32 full KV = 0.5; GPU bf16: 1)."""
    from benchmarks.capacity_model import resident_fraction

    c, reload_fraction = resident_fraction(spec, head_dim=64, kv_elem_bytes=2 if draft_over_full >= 1 else 4)
    return c * draft_over_full if reload_fraction < 1 else c


if __name__ == "__main__":
    sys.exit(main())
