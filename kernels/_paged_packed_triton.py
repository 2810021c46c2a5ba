"""Triton kernel of paged_packed.py (needs triton; imported lazily by the dispatch): split-K attention over a
packed paged prefix (KIVI 2/4/8-bit, int8, fp8 per-token) and a float paged tail, codes dequantized in
registers tile by tile.

Grid (B * Hkv, NSPLIT + 1): programs 0..NSPLIT-1 each own a contiguous chunk of every row's prefix (whole
tiles of BLOCK_N tokens inside one block of bs), the last one the row's tail (causal bottom-right). Rows of a
program are the G query heads of the KV head times the row's Lq queries (M = G * Lq, padded to BLOCK_M);
each writes an unnormalised partial (o, log2-sum-exp) and _combine merges them straight into out [N, Hq, D].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._attn_triton import _NEG, _online_step

_KIND = {"kivi": 0, "int8": 1, "fp8": 2}
_CDT = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _fp8(c):
    """float8 e4m3fn codes (uint8, as int32) -> float32, subnormals included."""
    e = (c >> 3) & 15
    m = (c & 7).to(tl.float32)
    mag = tl.where(e == 0, m * 0.001953125, (8.0 + m) * tl.exp2((e - 10).to(tl.float32)))
    return tl.where((c & 128) != 0, -mag, mag)


@triton.jit
def _packed_split(
    Q,
    QSL,
    OP,
    LP,
    KC,
    KS,
    KZ,
    VC,
    VS,
    VZ,
    PLEN,
    PTAB,
    TK,
    TV,
    TLEN,
    TTAB,
    pw,
    tw,
    H,
    HQ,
    M_MAX,
    chunk,
    NSPLIT,
    qk_scale,
    KIND: tl.constexpr,
    K_BITS: tl.constexpr,
    V_BITS: tl.constexpr,
    K_GROUP: tl.constexpr,
    V_GROUP: tl.constexpr,
    BS: tl.constexpr,
    TBS: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
    CDT: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    q0 = tl.load(QSL + b)
    lq = tl.load(QSL + b + 1) - q0
    rows = tl.arange(0, BLOCK_M)
    rmask = rows < G * lq
    g = rows // tl.maximum(lq, 1)
    i = rows % tl.maximum(lq, 1)
    offs_d = tl.arange(0, D)
    qptr = Q + ((q0 + i).to(tl.int64) * HQ + h * G + g)[:, None] * D + offs_d[None, :]
    q = tl.load(qptr, mask=rmask[:, None], other=0.0).to(CDT)
    m_i = tl.full([BLOCK_M], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    if pid_s < NSPLIT:  # a chunk of the packed prefix: fully visible
        n = tl.load(PLEN + b)
        start = pid_s * chunk
        end = tl.minimum(start + chunk, n)
        for n0 in range(start, end, BLOCK_N):
            bid = tl.load(PTAB + b.to(tl.int64) * pw + n0 // BS).to(tl.int64)
            bh = bid * H + h
            o = n0 % BS + offs_n  # offsets inside the block
            tmask = n0 + offs_n < end
            if KIND == 0:
                kb = tl.load(
                    KC + (bh * D + offs_d[None, :]) * (BS * K_BITS // 8) + (o * K_BITS // 8)[:, None],
                    mask=tmask[:, None],
                    other=0,
                ).to(tl.int32)
                kcode = (kb >> ((o * K_BITS) % 8)[:, None]) & ((1 << K_BITS) - 1)
                sidx = (bh * D + offs_d[None, :]) * (BS // K_GROUP) + (o // K_GROUP)[:, None]
                ks = tl.load(KS + sidx, mask=tmask[:, None], other=0.0).to(tl.float32)
                kz = tl.load(KZ + sidx, mask=tmask[:, None], other=0.0).to(tl.float32)
                k = kcode.to(tl.float32) * ks + kz
                vb = tl.load(
                    VC + (bh * BS + o[:, None]) * (D * V_BITS // 8) + (offs_d * V_BITS // 8)[None, :],
                    mask=tmask[:, None],
                    other=0,
                ).to(tl.int32)
                vcode = (vb >> ((offs_d * V_BITS) % 8)[None, :]) & ((1 << V_BITS) - 1)
                vidx = (bh * BS + o[:, None]) * (D // V_GROUP) + (offs_d // V_GROUP)[None, :]
                vs = tl.load(VS + vidx, mask=tmask[:, None], other=0.0).to(tl.float32)
                vz = tl.load(VZ + vidx, mask=tmask[:, None], other=0.0).to(tl.float32)
                v = vcode.to(tl.float32) * vs + vz
            else:
                kc = tl.load(KC + (bh * D + offs_d[None, :]) * BS + o[:, None], mask=tmask[:, None], other=0)
                vc = tl.load(VC + (bh * BS + o[:, None]) * D + offs_d[None, :], mask=tmask[:, None], other=0)
                if KIND == 1:
                    kf = kc.to(tl.float32)
                    vf = vc.to(tl.float32)
                else:
                    kf = _fp8(kc.to(tl.int32))
                    vf = _fp8(vc.to(tl.int32))
                ks = tl.load(KS + bh * BS + o, mask=tmask, other=0.0).to(tl.float32)
                vs = tl.load(VS + bh * BS + o, mask=tmask, other=0.0).to(tl.float32)
                k = kf * ks[:, None]
                v = vf * vs[:, None]
            m_i, l_i, acc = _online_step(q, k.to(CDT), v.to(CDT), tmask[None, :], m_i, l_i, acc, qk_scale, PREC)
    else:  # the float tail: query i sees tail entries j <= nt - lq + i
        nt = tl.load(TLEN + b)
        last = nt - lq + i
        for n0 in range(0, nt, BLOCK_N):
            bid = tl.load(TTAB + b.to(tl.int64) * tw + n0 // TBS).to(tl.int64)
            bh = bid * H + h
            o = n0 % TBS + offs_n
            t = n0 + offs_n
            tmask = t < nt
            k = tl.load(TK + (bh * D + offs_d[None, :]) * TBS + o[:, None], mask=tmask[:, None], other=0.0)
            v = tl.load(TV + (bh * TBS + o[:, None]) * D + offs_d[None, :], mask=tmask[:, None], other=0.0)
            vis = tmask[None, :] & (t[None, :] <= last[:, None])
            m_i, l_i, acc = _online_step(q, k.to(CDT), v.to(CDT), vis, m_i, l_i, acc, qk_scale, PREC)
    has = l_i > 0
    o_ = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), _NEG)
    slot = pid_bh.to(tl.int64) * (NSPLIT + 1) + pid_s
    tl.store(OP + (slot * M_MAX + rows[:, None]) * D + offs_d[None, :], o_, mask=rmask[:, None])
    tl.store(LP + slot * M_MAX + rows, lse, mask=rmask)


@triton.jit
def _combine(OP, LP, O, QSL, H, HQ, M_MAX, S, D: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr):
    pid_bh = tl.program_id(0)
    b = pid_bh // H
    h = pid_bh % H
    q0 = tl.load(QSL + b)
    lq = tl.load(QSL + b + 1) - q0
    rows = tl.arange(0, BLOCK_M)
    rmask = rows < G * lq
    offs_d = tl.arange(0, D)
    base = pid_bh.to(tl.int64) * S
    m = tl.full([BLOCK_M], _NEG, tl.float32)
    for s in range(0, S):
        m = tl.maximum(m, tl.load(LP + (base + s) * M_MAX + rows, mask=rmask, other=_NEG))
    num = tl.zeros([BLOCK_M, D], tl.float32)
    den = tl.zeros([BLOCK_M], tl.float32)
    for s in range(0, S):
        w = tl.exp2(tl.load(LP + (base + s) * M_MAX + rows, mask=rmask, other=_NEG) - m)
        o = tl.load(OP + ((base + s) * M_MAX + rows[:, None]) * D + offs_d[None, :], mask=rmask[:, None], other=0.0)
        num += w[:, None] * o
        den += w
    out = num / tl.where(den > 0, den, 1.0)[:, None]
    g = rows // tl.maximum(lq, 1)
    i = rows % tl.maximum(lq, 1)
    optr = O + ((q0 + i).to(tl.int64) * HQ + h * G + g)[:, None] * D + offs_d[None, :]
    tl.store(optr, out.to(O.dtype.element_ty), mask=rmask[:, None])


def _num_sms(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2  # TRITON_INTERPRET=1 on the CPU: a couple of splits, enough to exercise the combine


def packed_paged_attention_triton(
    q, query_start_loc, fmt, cache, prefix_lens, prefix_table, tail_k, tail_v, tail_lens, tail_table, sm_scale
):
    if q.dtype not in _CDT:
        raise ValueError(f"q dtype must be fp16/bf16/fp32, got {q.dtype}")
    n_rows = prefix_lens.shape[0]
    _, hq, d = q.shape
    hkv, bs, tbs = tail_k.shape[1], cache["v"].shape[2], tail_v.shape[2]
    g = hq // hkv
    qsl = query_start_loc.to(torch.int32).contiguous()
    lq_max = int((qsl[1:] - qsl[:-1]).max()) if n_rows else 0
    m_max = g * max(lq_max, 1)
    block_m = max(16, triton.next_power_of_2(m_max))
    block_n = min(64, bs, tbs)
    big = int(prefix_lens.max()) if n_rows else 0
    want = max(1, (2 * _num_sms(q.device)) // max(1, n_rows * hkv))
    chunk = max(block_n, triton.cdiv(triton.cdiv(max(big, 1), want), block_n) * block_n)
    nsplit = triton.cdiv(big, chunk) if big else 0
    dev = q.device
    part_o = torch.empty(n_rows * hkv, nsplit + 1, m_max, d, device=dev, dtype=torch.float32)
    part_l = torch.empty(n_rows * hkv, nsplit + 1, m_max, device=dev, dtype=torch.float32)
    out = torch.zeros_like(q)
    c = {name: x.contiguous() for name, x in cache.items()}
    ptab, ttab = prefix_table.to(torch.int32).contiguous(), tail_table.to(torch.int32).contiguous()
    _packed_split[(n_rows * hkv, nsplit + 1)](
        q.contiguous(),
        qsl,
        part_o,
        part_l,
        c["k"],
        c["k_scale"],
        c.get("k_mn", c["k_scale"]),
        c["v"],
        c["v_scale"],
        c.get("v_mn", c["v_scale"]),
        prefix_lens.to(torch.int32).contiguous(),
        ptab,
        tail_k.contiguous(),
        tail_v.contiguous(),
        tail_lens.to(torch.int32).contiguous(),
        ttab,
        ptab.shape[1] if ptab.dim() == 2 else 0,
        ttab.shape[1],
        hkv,
        hq,
        m_max,
        chunk,
        nsplit,
        sm_scale * 1.4426950408889634,
        KIND=_KIND[fmt.kind],
        K_BITS=fmt.k_bits,
        V_BITS=fmt.v_bits,
        K_GROUP=fmt.k_group,
        V_GROUP=fmt.v_group,
        BS=bs,
        TBS=tbs,
        D=d,
        G=g,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PREC="ieee" if q.dtype == torch.float32 else "tf32",
        CDT=_CDT[q.dtype],
        num_warps=4,
        num_stages=2,
    )
    _combine[(n_rows * hkv,)](part_o, part_l, out, qsl, hkv, hq, m_max, nsplit + 1, D=d, G=g, BLOCK_M=block_m)
    return out


def bytes_moved(cache: dict, prefix_lens, tail_lens, tail_k) -> int:
    """What one call must read at least (for the GPU check's bandwidth figure)."""
    bs = cache["v"].shape[2]
    per_token = sum(x[0].nbytes for x in cache.values()) / bs
    tail_tok = tail_k[0].nbytes * 2 / tail_k.shape[-1]
    return int(per_token * float(prefix_lens.sum()) + tail_tok * float(tail_lens.sum()))
