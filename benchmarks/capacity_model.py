"""Capacity model of long-context serving (the paper's Pipeline 1): what an HBM budget admits, and the host link.

Full KV keeps every request's KV resident; VeriCache keeps only the compressed KV (ratio c) and reloads the full
prompt KV over the host link (L bytes/s) for each verification, into a staging ring. With T context tokens, kv
bytes per token, W weight bytes and a KV budget H:

    full       B_f = floor(H / (T kv))                                       rows that fit
               step_f = pass(W + B_f T kv, B_f)                              one token per row per step
               thr_f  = B_f / step_f
    VeriCache  B_v = floor((H - S) / (c T kv))                               S: staging of the verifying rows
               per step: B_v drafting rows, and B_v / x rows verifying x drafts over their full KV
               step_v = pass(W + B_v c T kv + (B_v / x) T kv, B_v + (B_v / x)(x + 1))
               E(x)   = 1 + a + ... + a^x                                    tokens per verification
               thr_v  = min(B_v / (x step_v), L / (T kv)) * E(x)             the link moves one reload at a time
               x: the best horizon in [1, k_max];  a: the per-draft acceptance fitted to the measured curve

The paper's per-iteration bound is the link term: in one step the link moves at most L step_v bytes, so at most
L step_v / (T kv) verifications finish per step, and VeriCache emits at most that many E(x) tokens per step. pass()
is the roofline of cost_model.py (bytes / HBM bandwidth or FLOPs / peak, whichever is larger).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from cost_model import Hardware, Model, pass_s


def fit_alpha(k: int, accepted: float) -> float:
    """a with a + a^2 + ... + a^k = accepted (the mean accepted drafts of k), by bisection."""
    target = min(accepted, k - 1e-6)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        if sum(a**i for i in range(1, k + 1)) < target:
            lo = a
        else:
            hi = a
    return (lo + hi) / 2


def tokens_per_verify(alpha: float, x: int) -> float:
    return sum(alpha**i for i in range(x + 1))


@dataclass
class ServingPrediction:
    model: str
    hardware: str
    link_gbps: float
    context: int
    budget_gib: float
    compression: float
    alpha: float
    full_rows: int
    full_step_ms: float
    full_tokens_per_s: float
    vc_rows: int
    vc_horizon: int
    vc_step_ms: float
    vc_tokens_per_s: float
    link_bound: bool
    speedup: float


def predict_serving(
    hw: Hardware,
    m: Model,
    link_bytes_per_s: float,
    context: int,
    budget_bytes: float,
    compression: float,
    alpha: float,
    k_max: int = 64,
    staging_layers: int = 2,
    max_rows: int = 256,
) -> ServingPrediction:
    kv_req = context * m.kv_bytes_per_token
    rows_f = int(budget_bytes // kv_req)
    step_f = pass_s(hw, m, rows_f * kv_req, max(1, rows_f))
    thr_f = rows_f / step_f if rows_f else 0.0
    staging = kv_req * staging_layers / m.layers
    rows_v = min(max_rows, int(max(0.0, budget_bytes - staging) // (compression * kv_req)))
    best = (0.0, 1, step_f, False)
    reload_rate = link_bytes_per_s / kv_req  # verifications per second the link allows
    for x in range(1, k_max + 1):
        verifying = rows_v / x
        step_v = pass_s(
            hw, m, rows_v * compression * kv_req + verifying * kv_req, max(1, int(rows_v + verifying * (x + 1)))
        )
        verifies = min(rows_v / (x * step_v), reload_rate) if rows_v else 0.0
        thr = verifies * tokens_per_verify(alpha, x)
        if thr > best[0]:
            best = (thr, x, step_v, rows_v / (x * step_v) > reload_rate)
    thr_v, x, step_v, bound = best
    return ServingPrediction(
        m.name,
        hw.name,
        link_bytes_per_s / 1e9,
        context,
        budget_bytes / 2**30,
        compression,
        alpha,
        rows_f,
        step_f * 1e3,
        thr_f,
        rows_v,
        x,
        step_v * 1e3,
        thr_v,
        bound,
        thr_v / thr_f if thr_f else math.inf,
    )


def serving_table(preds: list[ServingPrediction]) -> str:
    lines = [
        "| model | GPU | link GB/s | ctx | KV budget GiB | c | a | full rows | full tok/s | VC rows | x | "
        "VC tok/s | link-bound | **speedup** |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for p in preds:
        lines.append(
            f"| {p.model} | {p.hardware} | {p.link_gbps:g} | {p.context} | {p.budget_gib:.1f} | "
            f"{p.compression:.3f} | {p.alpha:.2f} | {p.full_rows} | {p.full_tokens_per_s:.0f} | {p.vc_rows} | "
            f"{p.vc_horizon} | {p.vc_tokens_per_s:.0f} | {'yes' if p.link_bound else 'no'} | "
            f"**{p.speedup:.2f}x** |"
        )
    return "\n".join(lines)


def as_dict(p: ServingPrediction) -> dict:
    return asdict(p)
