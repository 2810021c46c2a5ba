"""Attention references shared by every cache layout, plus the verify and gathered (token-dropped)
attention ops.

Shapes: q [B, Hq, Lq, D] or [Hq, Lq, D] (no batch); every cache tensor then has the same leading
layout: prefix K/V [B?, Hkv, T, D], tail K/V [B?, Hkv, Lt, D]. GQA: query head hq reads KV head
hq // (Hq // Hkv) (the repeat_interleave convention of HF/SDPA enable_gqa).

Visibility ("prefix + tail" convention used by all ops):
* every prefix position (compressed / kept tokens) is visible to every query;
* the Lq queries are the last Lq positions of the tail (bottom-right causal): query i sees tail
  positions j <= Lt - Lq + i. With Lq == 1 the whole tail is visible.
verify_attention is the prefix-free case: K/V hold the whole sequence, queries are its last Lq.
Scores and softmax are computed in float32; the output has q's dtype.
"""

from __future__ import annotations

import math

import torch

from ._dispatch import use_triton

Tensor = torch.Tensor


def batched(q: Tensor, *caches: Tensor | None) -> tuple[bool, Tensor, list[Tensor | None]]:
    """Add a batch dim to q and caches when q is [Hq, Lq, D]. Returns (had_batch, q4, caches4)."""
    if q.dim() not in (3, 4):
        raise ValueError(f"q must be [B, Hq, Lq, D] or [Hq, Lq, D], got shape {tuple(q.shape)}")
    had = q.dim() == 4
    out = [c if (c is None or had) else c.unsqueeze(0) for c in caches]
    return had, (q if had else q.unsqueeze(0)), out


def check_attention_shapes(
    q: Tensor,
    k: Tensor | None,
    v: Tensor | None,
    k_tail: Tensor | None,
    v_tail: Tensor | None,
    n_prefix: int | None = None,
    hkv: int | None = None,
) -> int:
    """Validate 4-d shapes; returns Hkv. n_prefix/hkv describe a packed or indexed prefix."""
    b, hq, lq, d = q.shape
    if (k is None) != (v is None) or (k_tail is None) != (v_tail is None):
        raise ValueError("K and V must be given together (prefix and tail)")
    heads = hkv
    for name, t in (("k", k), ("v", v), ("k_tail", k_tail), ("v_tail", v_tail)):
        if t is None:
            continue
        if t.dim() != 4 or t.shape[0] != b or t.shape[-1] != d:
            raise ValueError(f"{name} must be [B={b}, Hkv, L, D={d}] like q, got {tuple(t.shape)}")
        heads = t.shape[1] if heads is None else heads
        if t.shape[1] != heads:
            raise ValueError(f"{name} has {t.shape[1]} KV heads, expected {heads}")
    if heads is None:
        raise ValueError("no keys given: pass a prefix and/or a tail")
    if hq % heads:
        raise ValueError(f"query heads {hq} not a multiple of KV heads {heads}")
    if k is not None and k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    if k_tail is not None and k_tail.shape != v_tail.shape:
        raise ValueError(f"k_tail {tuple(k_tail.shape)} and v_tail {tuple(v_tail.shape)} differ")
    t = n_prefix if n_prefix is not None else (0 if k is None else k.shape[2])
    lt = 0 if k_tail is None else k_tail.shape[2]
    if t == 0 and lt < lq:
        raise ValueError(f"{lq} queries but no prefix and only {lt} tail keys: a query would see no key")
    return heads


def tail_visibility(lq: int, lt: int, rows: int, device) -> Tensor:
    """Bool [rows, Lt]: row r (query i = r % Lq) sees tail j iff j <= Lt - Lq + i."""
    i = torch.arange(rows, device=device) % lq
    return torch.arange(lt, device=device)[None, :] <= (lt - lq + i)[:, None]


def attention_ref(
    q: Tensor,
    k: Tensor | None,
    v: Tensor | None,
    k_tail: Tensor | None = None,
    v_tail: Tensor | None = None,
    sm_scale: float | None = None,
) -> Tensor:
    """softmax(q K^T * scale) V over [prefix; tail], fp32 math, GQA without repeating K/V.

    The Lq queries of the G = Hq/Hkv heads sharing a KV head are stacked into G*Lq rows, so each KV
    head is read once by one batched matmul; prefix and tail scores are concatenated (cheap: scores,
    not keys) before one softmax, and the two value products are summed.
    """
    had, q4, (k, v, k_tail, v_tail) = batched(q, k, v, k_tail, v_tail)
    hkv = check_attention_shapes(q4, k, v, k_tail, v_tail)
    b, hq, lq, d = q4.shape
    g = hq // hkv
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    qf = q4.float().reshape(b, hkv, g * lq, d) * scale  # rows r = g_idx * Lq + i
    parts, vals = [], []
    if k is not None and k.shape[2]:
        parts.append(qf @ k.float().transpose(-1, -2))  # [B, Hkv, G*Lq, T]
        vals.append(v)
    if k_tail is not None and k_tail.shape[2]:
        s = qf @ k_tail.float().transpose(-1, -2)  # [B, Hkv, G*Lq, Lt]
        if lq > 1:
            vis = tail_visibility(lq, k_tail.shape[2], g * lq, q.device)
            s = s.masked_fill(~vis, float("-inf"))
        parts.append(s)
        vals.append(v_tail)
    p = torch.softmax(torch.cat(parts, -1) if len(parts) > 1 else parts[0], dim=-1)
    out, start = None, 0
    for val in vals:  # out = sum_j p_j v_j, per part
        n = val.shape[2]
        o = p[..., start : start + n] @ val.float()
        out = o if out is None else out + o
        start += n
    out = out.reshape(b, hkv, g, lq, d).reshape(b, hq, lq, d).to(q.dtype)
    return out if had else out.squeeze(0)


def attention_ref_streamed(
    q: Tensor,
    hkv: int,
    n_prefix: int,
    load_k,
    load_v,
    block: int,
    k_tail: Tensor | None = None,
    v_tail: Tensor | None = None,
    sm_scale: float | None = None,
) -> Tensor:
    """attention_ref for a prefix that is decoded block by block (compressed caches).

    load_k(s, e) / load_v(s, e) return float32 K/V [B, Hkv, e-s, D] of prefix positions [s, e);
    q and the tail are 4-d. Same math as attention_ref: all scores (small) are collected, one
    softmax, then out = sum over blocks p[:, s:e] @ V[s:e] (+ the tail). Decoding `block` tokens
    at a time keeps temporaries small (cache-resident, reused by the allocator) instead of
    materialising the whole dequantized cache.
    """
    check_attention_shapes(q, None, None, k_tail, v_tail, n_prefix=n_prefix, hkv=hkv)
    b, hq, lq, d = q.shape
    rows = hq // hkv * lq
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    qf = q.float().reshape(b, hkv, rows, d) * scale
    blocks = [(s, min(s + block, n_prefix)) for s in range(0, n_prefix, block)]
    parts = [qf @ load_k(s, e).transpose(-1, -2) for s, e in blocks]  # [B, Hkv, rows, e-s]
    lt = 0 if k_tail is None else k_tail.shape[2]
    if lt:
        st = qf @ k_tail.float().transpose(-1, -2)
        if lq > 1:
            st = st.masked_fill(~tail_visibility(lq, lt, rows, q.device), float("-inf"))
        parts.append(st)
    p = torch.softmax(torch.cat(parts, -1), dim=-1)
    out = p[..., n_prefix:] @ v_tail.float() if lt else torch.zeros_like(qf)
    for s, e in blocks:
        out = out + p[..., s:e] @ load_v(s, e)
    return out.reshape(b, hkv, hq // hkv, lq, d).reshape(b, hq, lq, d).to(q.dtype)


def block_tokens(b: int, hkv: int, d: int, multiple: int, target_bytes: int = 4 << 20) -> int:
    """Tokens per decoded block so that one float32 [B, Hkv, block, D] block is ~target_bytes."""
    return max(multiple, target_bytes // (4 * b * hkv * d) // multiple * multiple)


def verify_attention_ref(q: Tensor, k: Tensor, v: Tensor, sm_scale: float | None = None) -> Tensor:
    """Verify pass: q [B?, Hq, Lq, D] are the last Lq positions of K/V [B?, Hkv, T, D] (causal)."""
    return attention_ref(q, None, None, k, v, sm_scale)


def verify_attention(
    q: Tensor, k: Tensor, v: Tensor, sm_scale: float | None = None, *, backend: str = "auto"
) -> Tensor:
    """Causal attention of the last Lq = k+1 positions over the full KV (GQA) -> [B?, Hq, Lq, D]."""
    if use_triton(backend, q, k, v):
        from ._attn_triton import dense_attention_triton, triton_supports

        if triton_supports(q.shape[-1]):
            return dense_attention_triton(q, None, None, k, v, sm_scale)
    return verify_attention_ref(q, k, v, sm_scale)


def _check_idx(kept_idx: Tensor, k_full: Tensor) -> None:
    if kept_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"kept_idx must be int32/int64, got {kept_idx.dtype}")
    if kept_idx.dim() != k_full.dim() - 1 or kept_idx.shape[:-1] != k_full.shape[:-2]:
        raise ValueError(f"kept_idx {tuple(kept_idx.shape)} must be [B?, Hkv, L] for K {tuple(k_full.shape)}")


def gathered_attention_ref(
    q: Tensor,
    k_full: Tensor,
    v_full: Tensor,
    kept_idx: Tensor,
    k_tail: Tensor | None = None,
    v_tail: Tensor | None = None,
    sm_scale: float | None = None,
) -> Tensor:
    """Reference: K_kept[h, l] = K_full[h, kept_idx[h, l]] (per KV head), then attention_ref."""
    _check_idx(kept_idx, k_full)
    *lead, t, d = k_full.shape
    # row gather on the flattened [prod(lead) * T, D] view: row (slice s, position p) = s * T + p
    base = torch.arange(kept_idx[..., 0].numel(), device=kept_idx.device).reshape(kept_idx.shape[:-1]) * t
    rows = (kept_idx.long() + base.unsqueeze(-1)).reshape(-1)

    def gather(x):
        return x.reshape(-1, d).index_select(0, rows).reshape(*kept_idx.shape, d)

    return attention_ref(q, gather(k_full), gather(v_full), k_tail, v_tail, sm_scale)


def gathered_attention(
    q: Tensor,
    k_full: Tensor,
    v_full: Tensor,
    kept_idx: Tensor,
    k_tail: Tensor | None = None,
    v_tail: Tensor | None = None,
    sm_scale: float | None = None,
    *,
    backend: str = "auto",
) -> Tensor:
    """Attention over the kept positions of a token-dropped cache: K/V_full [B?, Hkv, T, D],
    kept_idx [B?, Hkv, L] (int32/int64, values in [0, T); the Triton kernel does not bounds-check),
    plus an optional tail. The kernel gathers rows inside the kernel; nothing is materialized."""
    _check_idx(kept_idx, k_full)
    if use_triton(backend, q, k_full, v_full, kept_idx):
        from ._attn_triton import gathered_attention_triton, triton_supports

        if triton_supports(q.shape[-1]):
            return gathered_attention_triton(q, k_full, v_full, kept_idx, k_tail, v_tail, sm_scale)
    return gathered_attention_ref(q, k_full, v_full, kept_idx, k_tail, v_tail, sm_scale)
