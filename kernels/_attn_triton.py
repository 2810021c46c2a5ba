"""Triton split-K (flash-decoding) attention over the "prefix + tail" layout (needs triton; imported
lazily by the dispatch functions).

One kernel, specialised at compile time by MODE, reads the prefix in its stored form:
  MODE 0 dense     K/V [B, Hkv, T, D] (any float dtype)
  MODE 1 gathered  K/V_full [B, Hkv, T_full, D] at rows kept_idx[b, h, :] (gather in-kernel)
  MODE 2 KIVI      packed codes + fp16 scale/min, dequantized in registers (kernels/kivi.py format)
  MODE 3 turbo     packed codes * fp16 norm via a codebook lookup, in the rotated domain
The tail [B, Hkv, Lt, D] is always dense, causal bottom-right (see kernels/attention.py).

Grid (B*Hkv, cdiv(M, BLOCK_M), NSPLIT + 1) with M = G*Lq rows (the G query heads sharing a KV head
times the Lq queries, so each K/V tile is read once per KV head): programs 0..NSPLIT-1 each own a
contiguous chunk of the prefix, the last one owns the tail. Each writes an unnormalised partial
(o, log2-sum-exp); _combine_kernel merges them. Scores use exp2 with sm_scale*log2(e) folded in.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .attention import batched, check_attention_shapes

_NEG = tl.constexpr(-1.0e30)  # finite "minus infinity": keeps exp2(m_old - m_new) NaN-free on empty rows


def triton_supports(d: int, *bits: int) -> bool:
    """Shapes the kernel handles (else the dispatch falls back to the reference)."""
    return d in (16, 32, 64, 128, 256) and all(b in (1, 2, 4, 8) for b in bits)


@triton.jit
def _load_rows(
    X,
    S,
    Z,
    CB,
    t,
    tmask,
    offs_d,
    sxt,
    sst,
    MODE: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    KEY_LAYOUT: tl.constexpr,
    CDT: tl.constexpr,
):
    """Rows t (int64 [BN]) of one (b, h) slice -> [BN, D] tile in CDT (masked rows are 0)."""
    if MODE <= 1:
        x = tl.load(X + t[:, None] * sxt + offs_d[None, :], mask=tmask[:, None], other=0.0)
    else:
        byte = tl.load(X + t[:, None] * sxt + (offs_d * BITS // 8)[None, :], mask=tmask[:, None], other=0)
        code = (byte.to(tl.int32) >> ((offs_d * BITS) % 8)[None, :]) & ((1 << BITS) - 1)
        if MODE == 2:
            # KIVI: x = code * scale + mn; keys: scale[t // G, d], values: scale[t, d // Gv]
            if KEY_LAYOUT:
                sidx = (t // GROUP)[:, None] * sst + offs_d[None, :]
            else:
                sidx = t[:, None] * sst + (offs_d // GROUP)[None, :]
            sc = tl.load(S + sidx, mask=tmask[:, None], other=0.0).to(tl.float32)
            mn = tl.load(Z + sidx, mask=tmask[:, None], other=0.0).to(tl.float32)
            x = code.to(tl.float32) * sc + mn
        else:
            # turbo: x_rot = norm[t] * codebook[code]
            nrm = tl.load(S + t * sst, mask=tmask, other=0.0).to(tl.float32)
            x = tl.load(CB + code) * nrm[:, None]
    return x.to(CDT)


@triton.jit
def _online_step(q, k, v, vis, m_i, l_i, acc, qk_scale, PREC: tl.constexpr):
    """One block of online softmax: s = q k^T * scale*log2e; rescale running (m, l, acc)."""
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
    s = tl.where(vis, s, _NEG)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.where(vis, tl.exp2(s - m_new[:, None]), 0.0)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _attn_split_kernel(
    Q,
    OP,
    LP,
    KX,
    KS,
    KZ,
    KCB,
    VX,
    VS,
    VZ,
    VCB,
    IDX,
    KT,
    VT,
    skb,
    skh,
    skt,
    sksb,
    sksh,
    skst,
    svb,
    svh,
    svt,
    svsb,
    svsh,
    svst,
    sib,
    sih,
    sktb,
    skth,
    sktt,
    svtb,
    svth,
    svtt,
    H,
    M,
    T,
    LT,
    LQ,
    qk_scale,
    chunk,
    NSPLIT,
    MODE: tl.constexpr,
    K_BITS: tl.constexpr,
    V_BITS: tl.constexpr,
    K_GROUP: tl.constexpr,
    V_GROUP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
    CDT: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    offs_d = tl.arange(0, D)
    q = tl.load(
        Q + pid_bh.to(tl.int64) * M * D + rows[:, None] * D + offs_d[None, :], mask=rmask[:, None], other=0.0
    ).to(CDT)
    m_i = tl.full([BLOCK_M], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    if pid_s < NSPLIT:  # a chunk of the prefix: fully visible
        start = pid_s * chunk
        end = tl.minimum(start + chunk, T)
        kx = KX + b * skb + h * skh
        vx = VX + b * svb + h * svh
        ks = KS + b * sksb + h * sksh
        kz = KZ + b * sksb + h * sksh
        vs = VS + b * svsb + h * svsh
        vz = VZ + b * svsb + h * svsh
        for n0 in range(start, end, BLOCK_N):
            t = n0 + tl.arange(0, BLOCK_N)
            tmask = t < end
            if MODE == 1:
                rt = tl.load(IDX + b * sib + h * sih + t, mask=tmask, other=0).to(tl.int64)
            else:
                rt = t.to(tl.int64)
            k = _load_rows(kx, ks, kz, KCB, rt, tmask, offs_d, skt, skst, MODE, K_BITS, K_GROUP, True, CDT)
            v = _load_rows(vx, vs, vz, VCB, rt, tmask, offs_d, svt, svst, MODE, V_BITS, V_GROUP, False, CDT)
            m_i, l_i, acc = _online_step(q, k, v, tmask[None, :], m_i, l_i, acc, qk_scale, PREC)
    else:  # the dense tail: query i = row % Lq sees j <= Lt - Lq + i
        kt = KT + b * sktb + h * skth
        vt = VT + b * svtb + h * svth
        last = LT - LQ + rows % LQ
        for n0 in range(0, LT, BLOCK_N):
            t = n0 + tl.arange(0, BLOCK_N)
            tmask = t < LT
            k = tl.load(kt + t[:, None] * sktt + offs_d[None, :], mask=tmask[:, None], other=0.0).to(CDT)
            v = tl.load(vt + t[:, None] * svtt + offs_d[None, :], mask=tmask[:, None], other=0.0).to(CDT)
            vis = tmask[None, :] & (t[None, :] <= last[:, None])
            m_i, l_i, acc = _online_step(q, k, v, vis, m_i, l_i, acc, qk_scale, PREC)
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), _NEG)
    slot = pid_bh.to(tl.int64) * (NSPLIT + 1) + pid_s
    tl.store(OP + (slot * M + rows[:, None]) * D + offs_d[None, :], o, mask=rmask[:, None])
    tl.store(LP + slot * M + rows, lse, mask=rmask)


@triton.jit
def _combine_kernel(OP, LP, O, M, S, D: tl.constexpr, BLOCK_M: tl.constexpr):
    """out = sum_s 2^(lse_s - max) o_s / sum_s 2^(lse_s - max) (empty splits: lse = -1e30, o = 0)."""
    pid_bh = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    offs_d = tl.arange(0, D)
    m = tl.full([BLOCK_M], _NEG, tl.float32)
    for s in range(0, S):
        m = tl.maximum(m, tl.load(LP + (pid_bh * S + s) * M + rows, mask=rmask, other=_NEG))
    num = tl.zeros([BLOCK_M, D], tl.float32)
    den = tl.zeros([BLOCK_M], tl.float32)
    for s in range(0, S):
        w = tl.exp2(tl.load(LP + (pid_bh * S + s) * M + rows, mask=rmask, other=_NEG) - m)
        o = tl.load(OP + ((pid_bh * S + s) * M + rows[:, None]) * D + offs_d[None, :], mask=rmask[:, None], other=0.0)
        num += w[:, None] * o
        den += w
    out = num / den[:, None]
    tl.store(O + (pid_bh * M + rows[:, None]) * D + offs_d[None, :], out.to(O.dtype.element_ty), mask=rmask[:, None])


_CDT = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _num_sms(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # TRITON_INTERPRET=1 on CPU: a few splits, enough to exercise the combine


def _strides(x, n):
    return (0,) * n if x is None else tuple(x.stride()[:n])


def _run(
    q4,
    mode,
    hkv,
    n_prefix,
    kx=None,
    ks=None,
    kz=None,
    kcb=None,
    vx=None,
    vs=None,
    vz=None,
    vcb=None,
    idx=None,
    kt=None,
    vt=None,
    sm_scale=None,
    k_bits=8,
    v_bits=8,
    k_group=1,
    v_group=1,
):
    """Launch split + combine for 4-d inputs (all contiguous); returns [B, Hq, Lq, D] in q's dtype."""
    if q4.dtype not in _CDT:
        raise ValueError(f"q dtype must be fp16/bf16/fp32, got {q4.dtype}")
    b, hq, lq, d = q4.shape
    m_rows = (hq // hkv) * lq
    lt = 0 if kt is None else kt.shape[2]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    block_m = max(16, min(64, triton.next_power_of_2(m_rows)))
    block_n = 64 if (q4.dtype != torch.float32 or d <= 64) else 32
    m_blocks = triton.cdiv(m_rows, block_m)
    # flash-decoding split: aim for ~2 programs per SM over (B*Hkv*m_blocks) x splits
    want = max(1, (2 * _num_sms(q4.device)) // max(1, b * hkv * m_blocks))
    chunk = max(block_n, triton.cdiv(triton.cdiv(max(n_prefix, 1), want), block_n) * block_n)
    nsplit = triton.cdiv(n_prefix, chunk)
    dev = q4.device
    part_o = torch.empty(b * hkv, nsplit + 1, m_rows, d, device=dev, dtype=torch.float32)
    part_l = torch.empty(b * hkv, nsplit + 1, m_rows, device=dev, dtype=torch.float32)
    out = torch.empty_like(q4)
    dummy = q4
    grid = (b * hkv, m_blocks, nsplit + 1)
    _attn_split_kernel[grid](
        q4,
        part_o,
        part_l,
        *(dummy if x is None else x for x in (kx, ks, kz, kcb, vx, vs, vz, vcb, idx, kt, vt)),
        *_strides(kx, 3),
        *_strides(ks, 3),
        *_strides(vx, 3),
        *_strides(vs, 3),
        *_strides(idx, 2),
        *_strides(kt, 3),
        *_strides(vt, 3),
        hkv,
        m_rows,
        n_prefix,
        lt,
        lq,
        scale * 1.4426950408889634,
        chunk,
        nsplit,
        MODE=mode,
        K_BITS=k_bits,
        V_BITS=v_bits,
        K_GROUP=k_group,
        V_GROUP=v_group,
        D=d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PREC="ieee" if q4.dtype == torch.float32 else "tf32",
        CDT=_CDT[q4.dtype],
        num_warps=4,
        num_stages=2,
    )
    _combine_kernel[(b * hkv, m_blocks)](part_o, part_l, out, m_rows, nsplit + 1, D=d, BLOCK_M=block_m)
    return out


def _c(x):
    return None if x is None else x.contiguous()


def dense_attention_triton(q, k, v, k_tail, v_tail, sm_scale=None):
    """Dense prefix (may be None) + tail; verify_attention is (None, None, K, V)."""
    had, q4, (k, v, kt, vt) = batched(q, k, v, k_tail, v_tail)
    hkv = check_attention_shapes(q4, k, v, kt, vt)
    out = _run(
        q4.contiguous(),
        0,
        hkv,
        0 if k is None else k.shape[2],
        kx=_c(k),
        vx=_c(v),
        kt=_c(kt),
        vt=_c(vt),
        sm_scale=sm_scale,
    )
    return out if had else out.squeeze(0)


def gathered_attention_triton(q, k_full, v_full, kept_idx, k_tail, v_tail, sm_scale=None):
    had, q4, (kf, vf, idx, kt, vt) = batched(q, k_full, v_full, kept_idx, k_tail, v_tail)
    hkv = check_attention_shapes(q4, kf, vf, kt, vt, n_prefix=idx.shape[-1])
    out = _run(
        q4.contiguous(),
        1,
        hkv,
        idx.shape[-1],
        kx=_c(kf),
        vx=_c(vf),
        idx=_c(idx),
        kt=_c(kt),
        vt=_c(vt),
        sm_scale=sm_scale,
    )
    return out if had else out.squeeze(0)


def _check_codes(name, x, b, hkv, t):
    if x.dim() != 4 or tuple(x.shape[:3]) != (b, hkv, t):
        raise ValueError(f"{name} must be [B={b}, Hkv={hkv}, T={t}, ...], got {tuple(x.shape)}")


def kivi_attention_triton(q, kp, ks, kz, vp, vs, vz, *, bits, v_bits, k_group, v_group, k_tail, v_tail, sm_scale=None):
    had, q4, (kp, ks, kz, vp, vs, vz, kt, vt) = batched(q, kp, ks, kz, vp, vs, vz, k_tail, v_tail)
    b, hkv, t, _ = kp.shape
    d = q4.shape[-1]
    hkv = check_attention_shapes(q4, None, None, kt, vt, n_prefix=t, hkv=hkv)
    _check_codes("v_packed", vp, b, hkv, t)
    if t % k_group or tuple(ks.shape) != (b, hkv, t // k_group, d) or kz.shape != ks.shape:
        raise ValueError(f"key scale/min {tuple(ks.shape)} != {(b, hkv, t // k_group, d)}")
    if d % v_group or tuple(vs.shape) != (b, hkv, t, d // v_group) or vz.shape != vs.shape:
        raise ValueError(f"value scale/min {tuple(vs.shape)} != {(b, hkv, t, d // v_group)}")
    out = _run(
        q4.contiguous(),
        2,
        hkv,
        t,
        kx=_c(kp),
        ks=_c(ks),
        kz=_c(kz),
        vx=_c(vp),
        vs=_c(vs),
        vz=_c(vz),
        kt=_c(kt),
        vt=_c(vt),
        sm_scale=sm_scale,
        k_bits=bits,
        v_bits=v_bits,
        k_group=k_group,
        v_group=v_group,
    )
    return out if had else out.squeeze(0)


def turbo_attention_triton(
    q_rot, kp, kn, vp, vn, k_codebook, v_codebook, *, bits, v_bits, k_tail, v_tail, sm_scale=None
):
    """q_rot and the tail already rotated; returns the output in the rotated domain."""
    had, q4, (kp, kn, vp, vn, kt, vt) = batched(q_rot, kp, kn, vp, vn, k_tail, v_tail)
    b, hkv, t, _ = kp.shape
    hkv = check_attention_shapes(q4, None, None, kt, vt, n_prefix=t, hkv=hkv)
    _check_codes("v_packed", vp, b, hkv, t)
    for name, n in (("k_norm", kn), ("v_norm", vn)):
        if tuple(n.shape) != (b, hkv, t):
            raise ValueError(f"{name} must be [B, Hkv, T] = {(b, hkv, t)}, got {tuple(n.shape)}")
    # norms [B, H, T]: pass as the "scale" tensors (strides b, h, t)
    out = _run(
        q4.contiguous(),
        3,
        hkv,
        t,
        kx=_c(kp),
        ks=_c(kn),
        kcb=_c(k_codebook),
        vx=_c(vp),
        vs=_c(vn),
        vcb=_c(v_codebook),
        kt=_c(kt),
        vt=_c(vt),
        sm_scale=sm_scale,
        k_bits=bits,
        v_bits=v_bits,
    )
    return out if had else out.squeeze(0)
