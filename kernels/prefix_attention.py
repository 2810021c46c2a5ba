"""Attention split into a fully visible prefix and a causal tail, merged by log-sum-exp: the pieces of
a draft step over [compressed prompt prefix; exact KV of the emitted tokens].

Softmax over two key sets is exact from each part's output and log-sum-exp l = log sum_j exp(s_j):
    out = (exp(l1) * o1 + exp(l2) * o2) / (exp(l1) + exp(l2))
so the prefix can be read in its own storage dtype (half precision on CPU) by a fused kernel while the
short tail runs in the model's dtype with a length per row.

Shapes and GQA as in kernels.attention: q [B, Hq, Lq, D], K/V [B, Hkv, T, D]; the G = Hq/Hkv query
heads of a KV head are stacked into G*Lq rows, so each KV head is read once.

  prefix_attention_lse(q, k, v)          all T positions visible -> (out, lse), float32
  tail_attention_lse(q, k, v, lengths)   row b holds lengths[b] valid tail entries, its Lq queries are
                                         the last Lq of them (causal bottom-right) -> (out, lse)
  merge_attention(o1, l1, o2, l2)        -> float32 out
  prefix_attention(q, k, v, k_tail, v_tail)   attention_ref semantics, one call: the Triton dense
                                         kernel on CUDA, the fused CPU path on CPU, attention_ref for "ref"
  cache_attention(q, k, v, lengths)      one batched cache with a length per row (prefix and tail in
                                         one buffer, as a draft KVCache in float16 holds them): the
                                         fused CPU kernel in one call; verify_attention per row on CUDA

The fused CPU path is PyTorch's CPU flash-attention kernel
(aten._scaled_dot_product_flash_attention_for_cpu, which returns the log-sum-exp) on the stacked
rows, q cast to the prefix dtype (float32 accumulation and softmax inside; output rounded to that
dtype). Stacking the GQA rows is what makes it fast: the same float32 K/V through SDPA with
enable_gqa (the model's KVCache path) is ~1.35x slower at 8k context (benchmarks/engine_step_time.py,
rows full vs full/dense-f32).
"""

from __future__ import annotations

import math

import torch

from ._dispatch import use_fused_cpu, use_triton
from .attention import attention_ref, batched, check_attention_shapes, verify_attention

Tensor = torch.Tensor
FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _stack(q: Tensor, hkv: int, scale: float) -> Tensor:
    """q [B, Hq, Lq, D] -> float32 [B, Hkv, G*Lq, D] * scale (rows r = g * Lq + i)."""
    b, hq, lq, d = q.shape
    return q.float().reshape(b, hkv, hq // hkv * lq, d) * scale


def _unstack(o: Tensor, lse: Tensor, hq: int, lq: int) -> tuple[Tensor, Tensor]:
    b, _, _, d = o.shape
    return o.reshape(b, hq, lq, d), lse.reshape(b, hq, lq)


def _check(q: Tensor, k: Tensor, v: Tensor) -> int:
    if q.dim() != 4:
        raise ValueError(f"q must be [B, Hq, Lq, D], got shape {tuple(q.shape)}")
    return (
        check_attention_shapes(q, None, None, k, v)
        if k.shape[2]
        else check_attention_shapes(q, None, None, None, None, n_prefix=1, hkv=k.shape[1])
    )


def _empty(q: Tensor) -> tuple[Tensor, Tensor]:
    return torch.zeros(q.shape, dtype=torch.float32, device=q.device), torch.full(
        q.shape[:3], float("-inf"), device=q.device
    )


def prefix_attention_lse_ref(q: Tensor, k: Tensor, v: Tensor, sm_scale: float | None = None) -> tuple[Tensor, Tensor]:
    """Reference: float32 softmax(q K^T * scale) V over all T positions, and its log-sum-exp."""
    hkv = _check(q, k, v)
    if not k.shape[2]:
        return _empty(q)
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    s = _stack(q, hkv, scale) @ k.float().transpose(-1, -2)
    lse = torch.logsumexp(s, -1)
    return _unstack(torch.exp(s - lse[..., None]) @ v.float(), lse, q.shape[1], q.shape[2])


def prefix_attention_lse(
    q: Tensor, k: Tensor, v: Tensor, sm_scale: float | None = None, *, backend: str = "auto"
) -> tuple[Tensor, Tensor]:
    """(out float32 [B, Hq, Lq, D], lse float32 [B, Hq, Lq]) of q over a fully visible prefix K/V
    [B, Hkv, T, D] (any float dtype; T may be 0: out 0, lse -inf). CPU: the fused flash kernel."""
    hkv = _check(q, k, v)
    if not (k.shape[2] and use_fused_cpu(backend, q, k, v) and k.dtype in FUSED_DTYPES and v.dtype == k.dtype):
        return prefix_attention_lse_ref(q, k, v, sm_scale)
    b, hq, lq, d = q.shape
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    qs = q.reshape(b, hkv, hq // hkv * lq, d).to(k.dtype)
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qs, k, v, scale=scale)
    return _unstack(o.float(), lse, hq, lq)


def tail_attention_lse(
    q: Tensor, k: Tensor, v: Tensor, lengths: Tensor | None = None, sm_scale: float | None = None
) -> tuple[Tensor, Tensor]:
    """(out, lse) of q over a causal tail K/V [B, Hkv, L, D], float32 math. Row b holds lengths[b]
    (default L) valid entries; its query i sees tail j <= lengths[b] - Lq + i. Entries past a row's
    length are never read into the result (masked), so they may hold anything finite."""
    hkv = _check(q, k, v)
    b, hq, lq, d = q.shape
    n = k.shape[2]
    if lengths is None:
        lengths = torch.full((b,), n, dtype=torch.long, device=q.device)
    if lengths.shape != (b,) or int(lengths.min()) < lq or int(lengths.max()) > n:
        raise ValueError(f"tail lengths {lengths.tolist()} must be [B={b}] values in [Lq={lq}, L={n}]")
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    s = _stack(q, hkv, scale) @ k.float().transpose(-1, -2)  # [B, Hkv, G*Lq, L]
    i = torch.arange(s.shape[2], device=q.device) % lq
    limit = lengths[:, None] - lq + i[None]  # [B, G*Lq]: last visible j
    vis = torch.arange(n, device=q.device)[None, None] <= limit[:, :, None]
    s = s.masked_fill(~vis[:, None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    return _unstack(torch.exp(s - lse[..., None]) @ v.float(), lse, hq, lq)


def cache_attention_ref(
    q: Tensor, k: Tensor, v: Tensor, lengths: Tensor | None = None, sm_scale: float | None = None
) -> Tensor:
    """Reference of cache_attention: tail_attention_lse's output in q's dtype."""
    return tail_attention_lse(q, k, v, lengths, sm_scale)[0].to(q.dtype)


def cache_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lengths: Tensor | None = None,
    sm_scale: float | None = None,
    *,
    backend: str = "auto",
) -> Tensor:
    """Decode attention over a batched cache K/V [B, Hkv, L, D] (any float dtype, views fine) whose row
    b holds lengths[b] valid entries (default L), the Lq queries being the last Lq of them (causal
    bottom-right per row) -> [B, Hq, Lq, D] in q's dtype. CUDA: verify_attention (Triton) per row
    length; CPU: the fused flash kernel on stacked GQA rows, q cast to K's dtype, masked only when
    rows differ or Lq > 1; backend="ref" (or VERICACHE_KERNELS=ref): cache_attention_ref."""
    hkv = _check(q, k, v)
    b, hq, lq, d = q.shape
    n = k.shape[2]
    if lengths is not None and (lengths.shape != (b,) or int(lengths.min()) < lq or int(lengths.max()) > n):
        raise ValueError(f"cache lengths {lengths.tolist()} must be [B={b}] values in [Lq={lq}, L={n}]")
    if use_triton(backend, q, k, v):
        if lengths is None or bool((lengths == n).all()):
            return verify_attention(q, k, v, sm_scale, backend=backend)
        return torch.cat(
            [
                verify_attention(q[i : i + 1], k[i : i + 1, :, :m], v[i : i + 1, :, :m], sm_scale, backend=backend)
                for i, m in enumerate(lengths.tolist())
            ]
        )
    if not (use_fused_cpu(backend, q, k, v) and k.dtype in FUSED_DTYPES and v.dtype == k.dtype):
        return cache_attention_ref(q, k, v, lengths, sm_scale)
    rows = hq // hkv * lq
    mask = None
    if lq > 1 or (lengths is not None and bool((lengths != n).any())):
        lens = torch.full((b,), n, device=q.device) if lengths is None else lengths
        limit = lens[:, None] - lq + torch.arange(rows, device=q.device)[None] % lq  # [B, rows]
        vis = torch.arange(n, device=q.device)[None, None] <= limit[:, :, None]
        mask = torch.zeros(vis.shape, dtype=k.dtype, device=q.device).masked_fill_(~vis, float("-inf"))[:, None]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    o, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.reshape(b, hkv, rows, d).to(k.dtype), k, v, attn_mask=mask, scale=scale
    )
    return o.reshape(b, hq, lq, d).to(q.dtype)


def merge_attention(o1: Tensor, l1: Tensor, o2: Tensor, l2: Tensor) -> Tensor:
    """Attention over the union of two disjoint key sets from each set's (out, lse); float32.
    A part with lse = -inf (no keys) gets weight 0; at least one part must have keys."""
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m)[..., None], torch.exp(l2 - m)[..., None]
    return (w1 * o1.float() + w2 * o2.float()) / (w1 + w2)


def prefix_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_tail: Tensor | None = None,
    v_tail: Tensor | None = None,
    sm_scale: float | None = None,
    *,
    backend: str = "auto",
) -> Tensor:
    """attention_ref semantics (prefix [B?, Hkv, T, D] fully visible, tail [B?, Hkv, Lt, D] causal
    bottom-right) -> [B?, Hq, Lq, D] in q's dtype. Triton dense kernel on CUDA; on CPU the fused
    prefix path merged with tail_attention_lse; backend="ref" (or VERICACHE_KERNELS=ref): attention_ref."""
    had, q4, (k4, v4, kt, vt) = batched(q, k, v, k_tail, v_tail)
    check_attention_shapes(q4, k4, v4, kt, vt)
    if use_triton(backend, q4, k4, v4, kt):
        from ._attn_triton import dense_attention_triton, triton_supports

        if triton_supports(q4.shape[-1]):
            out = dense_attention_triton(q4, k4, v4, kt, vt, sm_scale)
            return out if had else out.squeeze(0)
    if not use_fused_cpu(backend, q4, k4, v4, kt):
        return attention_ref(q, k, v, k_tail, v_tail, sm_scale)
    o, lse = prefix_attention_lse(q4, k4, v4, sm_scale, backend=backend)
    if kt is not None and kt.shape[2]:
        o = merge_attention(o, lse, *tail_attention_lse(q4, kt, vt, sm_scale=sm_scale))
    out = o.to(q.dtype)
    return out if had else out.squeeze(0)


__all__ = [
    "cache_attention",
    "cache_attention_ref",
    "prefix_attention",
    "prefix_attention_lse",
    "prefix_attention_lse_ref",
    "tail_attention_lse",
    "merge_attention",
]
