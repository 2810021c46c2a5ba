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

A finite trace (Workload.new_tokens > 0) is served row by row instead (finite_trace): each request with its own
acceptance (a distribution: the rows the engine has seen, not one mean), rows admitted as the scheduler admits them
(the row sizes of engine/sizes.py, Workload.vc_row_bytes / full_row_bytes), a VeriCache step costing its roofline
plus the overheads the engine measured (Hardware.step_overhead_s, verify_overhead_s), the trace ending with its
slowest rows, which go on on full KV at the tail where theirs fits. for_trace builds that workload for a
ServingEngine and its requests.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
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
    # what a VeriCache step costs beyond its roofline (Python, per-row sampling and bookkeeping), and each verification
    # in it beyond its attention (the serving engine measures both: ServingReport.step_overhead_s, verify_overhead_s)
    step_overhead_s: float = 0.0
    verify_overhead_s: float = 0.0


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
    # bytes a row holds, as the scheduler counts them (engine/sizes.py; 0: compression x context + row_bytes for
    # VeriCache, context x kv_bytes_per_token on full KV)
    vc_row_bytes: float = 0.0
    full_row_bytes: float = 0.0
    vc_reserve_bytes: float = 0.0  # what VeriCache admission keeps free beside the rows (0: a 2-layer staging ring)


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
    alpha: float | Sequence[float],
    reload_fraction: float = 1.0,
    staging_layers: int | None = 2,
    draft_keys: float = 1.0,
    tail_full: bool = True,
) -> Prediction:
    """Full KV against VeriCache on this hardware (see the module docstring); alpha: one per-draft acceptance, or
    the per-row acceptances seen (a finite trace's rows take them in turn; a steady state their mean); draft_keys:
    the fraction of the context a draft query attends (a token dropper's kept share; 1 for a quantizer);
    staging_layers None: the ring the serving engine stages (the layers the link cannot deliver within a step, plus
    double buffering); tail_full: a finite trace's last rows go on on full KV where theirs fits."""
    alphas = [alpha] if isinstance(alpha, (int, float)) else list(alpha)
    if not (0 < compression <= 1 and alphas and all(0 <= a <= 1 for a in alphas)):
        raise ValueError(f"need 0 < compression <= 1 and every alpha in [0, 1]; got {compression}, {alpha}")
    if not (0 <= reload_fraction <= 1 and 0 < draft_keys <= 1):
        raise ValueError(f"need 0 <= reload_fraction <= 1, 0 < draft_keys <= 1; got {reload_fraction}, {draft_keys}")
    kv_req = wl.context * wl.kv_bytes_per_token
    rows_f = waves(wl, min(wl.max_rows, int(wl.budget_bytes // (wl.full_row_bytes or kv_req))))
    step_f = pass_s(hw, wl, rows_f * kv_req, max(1, rows_f), dense=rows_f * wl.context)
    thr_f = rows_f / step_f if rows_f else 0.0
    link = hw.link_bytes_per_s * hw.devices
    reload_s = reload_fraction * kv_req / link if link > 0 else math.inf  # no link: no verification
    if wl.new_tokens:
        best = finite_trace(
            hw, wl, compression, per_request(alphas, wl.max_rows), reload_fraction, draft_keys, tail_full
        )
        best.full_rows, best.full_step_s, best.full_tokens_per_s = rows_f, step_f, thr_f
        return best
    alpha = statistics.fmean(alphas)
    ring = staging_layers or 2
    for _ in range(1 if staging_layers else 2):  # the engine's ring depends on the step time it gives
        staging = kv_req * reload_fraction * ring / wl.num_layers
        per_row = wl.vc_row_bytes or compression * kv_req + wl.row_bytes
        rows_v = waves(wl, min(wl.max_rows, int(max(0.0, wl.budget_bytes - staging) // per_row)))
        best = _vericache(hw, wl, rows_v, compression, alpha, reload_s, draft_keys)
        best.full_rows, best.full_step_s, best.full_tokens_per_s = rows_f, step_f, thr_f
        late = 0 if reload_s <= best.vc_step_s else math.ceil(wl.num_layers * (1 - best.vc_step_s / reload_s))
        late = min(late, wl.num_layers)
        ring = min(wl.num_layers, late + 2)
    return best


def per_request(alphas: list[float], n: int) -> list[float]:
    """n requests' acceptances from the rows seen: those rows in turn when there are n of them, else n evenly spaced
    quantiles of them, lowest first (the slowest rows admitted last: the trace's tail at its longest)."""
    if len(alphas) == n:
        return list(alphas)
    ranked = sorted(alphas)
    return [ranked[min(len(ranked) - 1, int((i + 0.5) * len(ranked) / n))] for i in range(n)]


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


def finite_trace(hw, wl, compression, alphas, reload_fraction, draft_keys, tail_full) -> "Prediction":
    """VeriCache over a finite trace (wl.max_rows requests of wl.new_tokens each, all there from the start), row by
    row: each request gets its own acceptance (alphas, in admission order), rows are admitted as the budget fits them
    (the scheduler's formula: wl.vc_row_bytes each, beside a 2-layer staging ring) after a prefill of wl.prefill_s,
    each emits E(a, x) tokens per round of x draft steps and one verify step, the step costs what its rows ask of
    the roofline plus the measured overheads, the link allows one reload at a time, and once nothing waits a row
    whose full KV fits goes on on it (tail_full, lowest acceptance first). The trace's time is when its last row
    ends: its slowest rows', which one mean acceptance hides. Best over the horizon x shared by all rows."""
    kv_req = wl.context * wl.kv_bytes_per_token
    per_row = wl.vc_row_bytes or compression * kv_req + wl.row_bytes
    full_row = wl.full_row_bytes or kv_req
    staging = wl.vc_reserve_bytes or kv_req * reload_fraction * 2 / wl.num_layers
    slots = min(wl.max_rows, int(max(0.0, wl.budget_bytes - staging) // per_row))
    link = hw.link_bytes_per_s * hw.devices
    reload_s = reload_fraction * kv_req / link if link > 0 else math.inf
    best = Prediction(0, 0.0, 0.0, slots, 1, 0.0, 0.0, False)
    if slots < 1 or not math.isfinite(reload_s):
        return best
    for x in range(1, wl.k_max + 1):
        t, steps, link_bound = _serve(
            hw, wl, compression, alphas, x, slots, per_row, full_row, reload_s, draft_keys, tail_full
        )
        thr = wl.max_rows * wl.new_tokens / t
        if thr > best.vc_tokens_per_s:
            best = Prediction(0, 0.0, 0.0, slots, x, t / max(steps, 1e-9), thr, link_bound)
    return best


def _serve(hw, wl, compression, alphas, x, slots, per_row, full_row, reload_s, draft_keys, tail_full):
    """Seconds (and steps) to serve the trace at horizon x (see finite_trace); whether the link bound it."""
    kv_req = wl.context * wl.kv_bytes_per_token
    queue = list(alphas)
    rows: list[list] = []  # [acceptance, tokens left, on full KV]
    t = steps = 0.0
    bound = False
    while queue or rows:
        while queue and len(rows) < slots:
            rows.append([queue.pop(0), float(wl.new_tokens), False])
            t += wl.prefill_s
        if not queue and tail_full:  # the tail: rows whose full KV fits go on on it, lowest acceptance first
            for row in sorted((r for r in rows if not r[2]), key=lambda r: r[0]):
                held = sum(full_row if r[2] else per_row for r in rows if r is not row)
                if held + full_row <= wl.budget_bytes:
                    row[2] = True
        n = sum(not r[2] for r in rows)
        m = len(rows) - n
        v = n / (x + 1)  # rows verifying in a step: a round is x draft steps and one verify step
        step = pass_s(
            hw,
            wl,
            (n - v) * compression * kv_req + (v + m) * kv_req,
            max(1, round(n + v * x + m)),
            dense=(v * (x + 1) + m) * wl.context,
            draft=(n - v) * draft_keys * wl.context,
        ) + (hw.step_overhead_s + v * hw.verify_overhead_s if n else 0.0)
        scale = 1.0
        if n and v * reload_s > step:  # the link moves one reload at a time: rounds wait for it
            scale, bound = step / (v * reload_s), True
        rate = [1.0 if r[2] else scale * expected_tokens(r[0], x) / (x + 1) for r in rows]
        dt = min(r[1] / q for r, q in zip(rows, rate))
        for r, q in zip(rows, rate):
            r[1] -= dt * q
        rows = [r for r in rows if r[1] > 1e-9]
        t += dt * step
        steps += dt
    return t, steps, bound


def for_trace(
    engine, trace, alpha: float | Sequence[float], hw: Hardware | None = None, prefill_s: float | None = None
) -> Prediction:
    """The model for a ServingEngine's trace (its requests) on hw (default: engine.cfg.hardware): full KV against
    VeriCache with this compressor as the pools hold it, rows sized by the scheduler's formula (engine.sizes), alpha
    the per-row acceptance (one figure or the rows seen), prefill_s what a VeriCache prefill adds (default
    engine.cfg.prefill_s)."""
    from .sequence import Sequence as Row

    cfg, mc, bs = engine.cfg, engine.model.cfg, engine.cfg.block_size
    hw = hw or cfg.hardware
    rows = [Row(r) for r in trace]
    ctx = statistics.fmean(len(r.prompt_ids) + r.max_new_tokens / 2 for r in trace)
    full = engine.full_bytes_per_token
    comp = engine.compressor
    keys = comp.keep_count(int(ctx)) / ctx if hasattr(comp, "keep_count") else 1.0
    if engine.packed is not None:  # codes and scales per token, against full KV
        c = engine.sizes.block_bytes["packed"] / (bs * full)
    else:
        c = keys * engine.sizes.block_bytes["draft"] / engine.sizes.block_bytes["full"]
    params = sum(p.numel() for p in engine.model.parameters())
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    budget = (
        cfg.budget_bytes
        if cfg.budget_bytes is not None
        else sum(full * (len(r.prompt_ids) + r.max_new_tokens) for r in trace)
    )
    k_max = max(1, min(cfg.k_max, max(r.max_new_tokens for r in trace)))  # no round drafts past the output
    wl = Workload(
        weights,
        params,
        full,
        mc.num_layers,
        int(ctx),
        budget,
        len(trace),
        k_max,
        attn_flops_per_pair=4 * mc.num_heads * mc.head_dim * mc.num_layers,
        new_tokens=statistics.fmean(r.max_new_tokens for r in trace),
        prefill_s=cfg.prefill_s if prefill_s is None else prefill_s,
        vc_row_bytes=statistics.fmean(engine.sizes.resident_bytes(r, full=False) for r in rows),
        full_row_bytes=statistics.fmean(engine.sizes.resident_bytes(r, full=True) for r in rows),
        vc_reserve_bytes=max(engine.sizes.transient_bytes(r, full=False) for r in rows),
    )
    reload = 1 - keys if engine.complement else 1.0
    tail = cfg.tail_full and not engine.complement
    return predict(hw, wl, min(1.0, c), alpha, reload, cfg.staging_layers, min(1.0, keys), tail)
