"""The capacity model of long-context serving (the paper's Pipeline 1): does offloading the full KV pay on this
hardware, for this trace and this drafter? The serving engine asks it before a VeriCache run
(ServingConfig.hardware: where it predicts a loss, the trace is served with full KV), and
benchmarks/capacity_model.py / cost_model.py --serving print it for GPUs.

A forward costs its linear layers then its attention, each at its roofline, over `devices` tensor-parallel devices:
pass = max(W / HBM, 2 P tokens / FLOP/s) + max(KV bytes / HBM, attention), attention = f (dense pairs / attn
FLOP/s + draft pairs / draft-attn FLOP/s): f = 4 Hq D L
FLOPs per (query, key) pair over the L layers, dense pairs over float KV (a verification's x + 1 queries over the
whole prompt, a full-KV row's one), draft pairs over the compressed KV as the draft pool holds it (dequantizing
packed codes included). On a GPU attention is memory-bound and its bytes are in the first term (the attention
rates default to the GEMM's); on a CPU its arithmetic is the cost, so engine/calibrate.py times the kernels.
With context T, full KV bytes per token kv, a device KV budget H:

    full       B_f = floor(H / (T kv))   rows;  step_f = pass(B_f T kv, B_f);  thr_f = B_f / step_f
    VeriCache  B_v = floor((H - S) / (c T kv))   rows (c: resident compressed bytes / full bytes, S: a staging
               ring of 2 layers);  per step B_v drafting rows and B_v / x rows verifying x drafts over their full
               KV:  step_v = pass(B_v c T kv + (B_v / x) T kv, B_v + (B_v / x)(x + 1));
               verifications / s = min(B_v / (x step_v), L / (r T kv))   (the link L moves one reload at a time;
               r: the fraction of the prompt a verification reloads, 1, or less with a complement reload);
               thr_v = verifications / s * E(x),  E(x) = 1 + a + ... + a^x,  x the best horizon in [1, k_max]

a is the per-draft acceptance (fit_alpha turns a measured mean of accepted drafts at horizon k into it).
Link rates are EFFECTIVE rates (what pinned host-to-device copies reach, below the nominal rate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Hardware:
    name: str
    mem_bytes_per_s: float  # device memory bandwidth, per device
    flops: float  # dense bf16 FLOP/s, per device
    mem_bytes: float  # device memory, per device
    link_bytes_per_s: float  # effective host link, per device
    devices: int = 1  # tensor parallel
    attn_flops: float | None = None  # attention over float KV, FLOP/s (None: flops)
    draft_attn_flops: float | None = None  # attention over the draft pool's compressed KV (None: attn_flops)


@dataclass(frozen=True)
class Workload:
    weight_bytes: float
    params: float
    kv_bytes_per_token: float  # full KV, all layers
    num_layers: int
    context: int
    budget_bytes: float  # device KV budget (all devices)
    max_rows: int = 256  # requests available (a trace has no more)
    k_max: int = 64
    attn_flops_per_pair: float = 0.0  # 4 Hq D L: one query against one key, every layer (0: no attention term)
    row_bytes: float = 0.0  # what a VeriCache row holds besides its compressed prompt (emitted tokens, drafts)
    # a finite trace (new_tokens > 0): max_rows requests of new_tokens each, served in waves of the rows that fit
    # (N / ceil(N / rows) rows on average: the last requests run with fewer), each VeriCache prefill adding
    # prefill_s (compression and the host copy, serialized with the steps)
    new_tokens: float = 0.0
    prefill_s: float = 0.0


@dataclass
class Prediction:
    full_rows: float  # rows at once (averaged over a finite trace's waves)
    full_step_s: float
    full_tokens_per_s: float
    vc_rows: float
    vc_horizon: int
    vc_step_s: float
    vc_tokens_per_s: float
    link_bound: bool

    @property
    def speedup(self) -> float:
        if self.full_tokens_per_s:
            return self.vc_tokens_per_s / self.full_tokens_per_s
        return math.inf if self.vc_tokens_per_s else 0.0


def pass_s(hw: Hardware, wl: Workload, kv_bytes: float, tokens: float, dense: float = 0.0, draft: float = 0.0) -> float:
    """One forward: `tokens` through the weights, then attention reading kv_bytes of KV over dense / draft (query,
    key) pairs; the two run one after the other, each at its own roofline."""
    bw, n = hw.mem_bytes_per_s * hw.devices, hw.devices
    attn = hw.attn_flops or hw.flops
    attention = wl.attn_flops_per_pair * (dense / attn + draft / (hw.draft_attn_flops or attn))
    return max(wl.weight_bytes / bw, 2 * wl.params * tokens / (hw.flops * n)) + max(kv_bytes / bw, attention / n)


def expected_tokens(alpha: float, x: int) -> float:
    return float(x + 1) if alpha >= 1 else (1 - alpha ** (x + 1)) / (1 - alpha)


def fit_alpha(k: int, accepted: float) -> float:
    """a with a + a^2 + ... + a^k = accepted (a measured mean of accepted drafts of k), by bisection."""
    target = min(accepted, k - 1e-6)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        if sum(a**i for i in range(1, k + 1)) < target:
            lo = a
        else:
            hi = a
    return (lo + hi) / 2


def predict(
    hw: Hardware,
    wl: Workload,
    compression: float,
    alpha: float,
    reload_fraction: float = 1.0,
    staging_layers: int | None = 2,
    draft_keys: float = 1.0,
) -> Prediction:
    """Full KV against VeriCache on this hardware (see the module docstring); draft_keys: the fraction of the
    context a draft query attends (a token dropper's kept share; 1 for a quantizer); staging_layers None: the
    ring the serving engine stages (the layers the link cannot deliver within a step, plus double buffering)."""
    if not (0 < compression <= 1 and 0 <= alpha <= 1 and 0 <= reload_fraction <= 1 and 0 < draft_keys <= 1):
        raise ValueError(
            f"need 0 < compression <= 1, 0 <= alpha, reload_fraction <= 1, 0 < draft_keys <= 1; got {compression}, "
            f"{alpha}, {reload_fraction}, {draft_keys}"
        )
    kv_req = wl.context * wl.kv_bytes_per_token
    rows_f = waves(wl, min(wl.max_rows, int(wl.budget_bytes // kv_req)))
    step_f = pass_s(hw, wl, rows_f * kv_req, max(1, rows_f), dense=rows_f * wl.context)
    thr_f = rows_f / step_f if rows_f else 0.0
    link = hw.link_bytes_per_s * hw.devices
    reload_s = reload_fraction * kv_req / link if link > 0 else math.inf  # no link: no verification
    ring = staging_layers or 2
    for _ in range(1 if staging_layers else 2):  # the engine's ring depends on the step time it gives
        staging = kv_req * reload_fraction * ring / wl.num_layers
        per_row = compression * kv_req + wl.row_bytes
        rows_v = waves(wl, min(wl.max_rows, int(max(0.0, wl.budget_bytes - staging) // per_row)))
        best = _vericache(hw, wl, rows_v, compression, alpha, reload_s, draft_keys)
        if wl.new_tokens and best.vc_tokens_per_s:  # the trace's tokens over their decode time + the prefills
            best.vc_tokens_per_s = wl.new_tokens / (wl.new_tokens / best.vc_tokens_per_s + wl.prefill_s)
        best.full_rows, best.full_step_s, best.full_tokens_per_s = rows_f, step_f, thr_f
        late = 0 if reload_s <= best.vc_step_s else math.ceil(wl.num_layers * (1 - best.vc_step_s / reload_s))
        late = min(late, wl.num_layers)
        ring = min(wl.num_layers, late + 2)
    return best


def waves(wl: Workload, rows: int) -> float:
    """Rows at once over a finite trace (see Workload): its requests in waves of `rows`, N / ceil(N / rows)."""
    if not wl.new_tokens or rows <= 0:
        return rows
    return wl.max_rows / math.ceil(wl.max_rows / rows)


def _vericache(hw, wl, rows_v, compression, alpha, reload_s, draft_keys) -> Prediction:
    """The best horizon for rows_v VeriCache rows (the full-KV fields are the caller's)."""
    kv_req = wl.context * wl.kv_bytes_per_token
    best = Prediction(0, 0.0, 0.0, rows_v, 1, 0.0, 0.0, False)
    for x in range(1, wl.k_max + 1):
        verifying = rows_v / x
        step_v = pass_s(
            hw,
            wl,
            rows_v * compression * kv_req + verifying * kv_req,
            max(1, int(rows_v + verifying * (x + 1))),
            dense=verifying * (x + 1) * wl.context,
            draft=rows_v * draft_keys * wl.context,
        )
        can = rows_v / (x * step_v) if rows_v else 0.0
        reloads = 1 / max(reload_s, 1e-30)  # verifications per second the link allows (one reload at a time)
        thr = min(can, reloads) * expected_tokens(alpha, x)
        if thr > best.vc_tokens_per_s or x == 1:
            best = Prediction(0, 0.0, 0.0, rows_v, x, step_v, thr, can > reloads)
    return best
