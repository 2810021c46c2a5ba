"""KIVI asymmetric quantization of K/V (the single source of truth for the format) and decode
attention that reads the packed cache.

Format (K and V are [..., T, D], canonically [H, T, D]; leading dims are carried through):

* keys, per-channel in groups of G tokens along T (T % G == 0):
  for each (..., t-group g, channel d): mn = min_t x, mx = max_t x over the G tokens,
  scale = (mx - mn) / (2**bits - 1), code = clamp(round((x - mn) / scale), 0, 2**bits - 1)
  (scale == 0 is divided as 1, so a constant group gets code 0 and is restored exactly).
  scale and mn are stored as float16 [..., T//G, D].
* values, per-token in groups of Gv channels along D (D % Gv == 0):
  the same math over each run of Gv channels; scale/mn float16 [..., T, D//Gv].
* codes of both are packed along D with kernels.bitpack (little-endian bit stream):
  packed uint8 [..., T, D*bits/8]; D must be a multiple of bitpack.pad_multiple(bits).
* dequantization, in float32: x = code * float(scale) + float(mn).

mn is rounded *down* and scale *up* to float16 before the codes are computed, and the codes use the
stored float16 values, so |x - dequant(x)| <= scale/2 holds with the stored scale (up to fp32
rounding; inputs must lie within the float16 range, |x| < 65504). Token counts that are not a
multiple of G are the caller's business: quantize the first kivi_split(T, G) tokens and keep the
rest full precision as the tail (the KIVI residual window).
"""

from __future__ import annotations

import torch

from ._dispatch import use_triton
from .attention import attention_ref_streamed, batched, block_tokens
from .bitpack import pack_bits_ref, pad_multiple
from .pack import unpack_bits_float


def _check(bits: int, group: int) -> None:
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an int in 1..8, got {bits!r}")
    if not isinstance(group, int) or group < 1:
        raise ValueError(f"group must be a positive int, got {group!r}")


def _fp16_round_up(x: torch.Tensor) -> torch.Tensor:
    """Smallest float16 >= x (x float32), by stepping the nearest fp16 one ulp when it fell short."""
    h = x.to(torch.float16)
    low = h.float() < x
    bits = h.view(torch.int16)
    # positive (incl. +0): next ulp up is bits+1; negative: bits-1 (towards zero); -0 -> +min subnormal
    up = torch.where(h > 0, bits + 1, torch.where(h < 0, bits - 1, torch.ones_like(bits)))
    return torch.where(low, up, bits).view(torch.float16)


def _fp16_round_down(x: torch.Tensor) -> torch.Tensor:
    """Largest float16 <= x."""
    return -_fp16_round_up(-x)


def kivi_split(num_tokens: int, group: int, min_residual: int = 0) -> int:
    """How many leading tokens to quantize (a multiple of `group`) leaving >= min_residual in full."""
    if num_tokens < 0 or min_residual < 0:
        raise ValueError(f"negative token count: {num_tokens=}, {min_residual=}")
    _check(1, group)
    return max(0, (num_tokens - min_residual) // group * group)


def _quantize_along(x: torch.Tensor, dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric quantization of x (float32) over `dim` -> codes (x's shape), scale16, mn16 (dim kept, size 1).
    Reduced along whichever dim the group runs in, so neither keys nor values are transposed for it."""
    levels = (1 << bits) - 1
    mn16 = _fp16_round_down(x.amin(dim, keepdim=True))
    mn = mn16.float()
    scale16 = _fp16_round_up((x.amax(dim, keepdim=True) - mn) / levels)
    div = scale16.float().masked_fill_(scale16 == 0, 1.0)
    codes = (x - mn).div_(div).round_().clamp_(0, levels).to(torch.uint8)
    return codes, scale16, mn16


def kivi_quantize_keys(k: torch.Tensor, bits: int, group: int):
    """K [..., T, D] -> (packed uint8 [..., T, D*bits/8], scale fp16 [..., T//G, D], mn fp16 same)."""
    _check(bits, group)
    *lead, t, d = k.shape
    if t % group:
        raise ValueError(f"key token count {t} is not a multiple of group {group} (use kivi_split)")
    if d % pad_multiple(bits):
        raise ValueError(f"head dim {d} does not pack into bytes at {bits} bits")
    # [..., T//G, G, D]: quantize along the G tokens of each group
    codes, scale, mn = _quantize_along(k.float().reshape(*lead, t // group, group, d), -2, bits)
    return pack_bits_ref(codes.reshape(*lead, t, d), bits), scale.squeeze(-2), mn.squeeze(-2)


def kivi_quantize_values(v: torch.Tensor, bits: int, group: int):
    """V [..., T, D] -> (packed uint8 [..., T, D*bits/8], scale fp16 [..., T, D//Gv], mn fp16 same)."""
    _check(bits, group)
    *lead, t, d = v.shape
    if d % group:
        raise ValueError(f"value head dim {d} is not a multiple of group {group}")
    if d % pad_multiple(bits):
        raise ValueError(f"head dim {d} does not pack into bytes at {bits} bits")
    codes, scale, mn = _quantize_along(v.float().reshape(*lead, t, d // group, group), -1, bits)
    return pack_bits_ref(codes.reshape(*lead, t, d), bits), scale.squeeze(-1), mn.squeeze(-1)


def _head_dim(packed: torch.Tensor, bits: int) -> int:
    return packed.shape[-1] * 8 // bits


def kivi_dequantize_keys(packed, scale, mn, bits: int, group: int, dtype=torch.float32) -> torch.Tensor:
    """Inverse of kivi_quantize_keys: x = code * scale + mn (float32 math) -> [..., T, D] in dtype."""
    _check(bits, group)
    *lead, t, nb = packed.shape
    d = _head_dim(packed, bits)
    if t % group or tuple(scale.shape) != (*lead, t // group, d) or mn.shape != scale.shape:
        raise ValueError(
            f"key scale/mn {tuple(scale.shape)}/{tuple(mn.shape)} do not match packed "
            f"{tuple(packed.shape)} at bits={bits}, group={group}"
        )
    codes = unpack_bits_float(packed, bits, d).reshape(*lead, t // group, group, d)
    # broadcast scale/mn [.., T//G, 1, D] over the G tokens of each group (no materialized repeat)
    x = torch.addcmul(mn.float().unsqueeze(-2), codes, scale.float().unsqueeze(-2))
    return x.reshape(*lead, t, d).to(dtype)


def kivi_dequantize_values(packed, scale, mn, bits: int, group: int, dtype=torch.float32) -> torch.Tensor:
    """Inverse of kivi_quantize_values -> [..., T, D] in dtype."""
    _check(bits, group)
    *lead, t, nb = packed.shape
    d = _head_dim(packed, bits)
    if d % group or tuple(scale.shape) != (*lead, t, d // group) or mn.shape != scale.shape:
        raise ValueError(
            f"value scale/mn {tuple(scale.shape)}/{tuple(mn.shape)} do not match packed "
            f"{tuple(packed.shape)} at bits={bits}, group={group}"
        )
    codes = unpack_bits_float(packed, bits, d).reshape(*lead, t, d // group, group)
    x = torch.addcmul(mn.float().unsqueeze(-1), codes, scale.float().unsqueeze(-1))
    return x.reshape(*lead, t, d).to(dtype)


def kivi_decode_attention_ref(
    q,
    k_packed,
    k_scale,
    k_mn,
    v_packed,
    v_scale,
    v_mn,
    *,
    bits: int,
    k_group: int,
    v_group: int,
    v_bits: int | None = None,
    k_tail=None,
    v_tail=None,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """Reference: dequantize the packed prefix to float32 and attend (attention_ref math: prefix
    fully visible, tail causal bottom-right, GQA, fp32 softmax). The prefix is dequantized in
    blocks of whole key groups (attention_ref_streamed) so the CPU path never materialises the
    full float32 cache."""
    v_bits = bits if v_bits is None else v_bits
    had, q4, (kp, ks, km, vp, vs, vm, kt, vt) = batched(
        q, k_packed, k_scale, k_mn, v_packed, v_scale, v_mn, k_tail, v_tail
    )
    b, hkv, t, _ = kp.shape
    if vp.shape[:3] != kp.shape[:3]:
        raise ValueError(f"k_packed {tuple(kp.shape)} and v_packed {tuple(vp.shape)} differ in [B, Hkv, T]")
    if t % k_group or ks.shape[-2] != t // k_group:
        raise ValueError(f"key scale {tuple(ks.shape)} does not match {t} tokens in groups of {k_group}")
    block = block_tokens(b, hkv, q4.shape[-1], k_group)

    def load_k(s, e):
        return kivi_dequantize_keys(
            kp[..., s:e, :],
            ks[..., s // k_group : e // k_group, :],
            km[..., s // k_group : e // k_group, :],
            bits,
            k_group,
        )

    def load_v(s, e):
        return kivi_dequantize_values(vp[..., s:e, :], vs[..., s:e, :], vm[..., s:e, :], v_bits, v_group)

    out = attention_ref_streamed(q4, hkv, t, load_k, load_v, block, kt, vt, sm_scale)
    return out if had else out.squeeze(0)


def kivi_decode_attention(
    q,
    k_packed,
    k_scale,
    k_mn,
    v_packed,
    v_scale,
    v_mn,
    *,
    bits: int,
    k_group: int,
    v_group: int,
    v_bits: int | None = None,
    k_tail=None,
    v_tail=None,
    sm_scale: float | None = None,
    backend: str = "auto",
):
    """Attention of q [B?, Hq, Lq, D] over a KIVI-packed prefix [B?, Hkv, T, ...] (keys at `bits`,
    values at `v_bits`, default `bits`) plus an optional full-precision tail [B?, Hkv, Lt, D].
    The whole prefix is visible; query i sees tail positions j <= Lt - Lq + i. -> [B?, Hq, Lq, D]."""
    v_bits = bits if v_bits is None else v_bits
    _check(bits, k_group)
    _check(v_bits, v_group)
    d = q.shape[-1]
    if _head_dim(k_packed, bits) != d or _head_dim(v_packed, v_bits) != d:
        raise ValueError(
            f"packed K/V last dims {k_packed.shape[-1]}/{v_packed.shape[-1]} do not hold "
            f"head dim {d} at {bits}/{v_bits} bits"
        )
    if use_triton(backend, q, k_packed, v_packed, k_tail):
        from ._attn_triton import kivi_attention_triton, triton_supports

        if triton_supports(d, bits, v_bits):
            return kivi_attention_triton(
                q,
                k_packed,
                k_scale,
                k_mn,
                v_packed,
                v_scale,
                v_mn,
                bits=bits,
                v_bits=v_bits,
                k_group=k_group,
                v_group=v_group,
                k_tail=k_tail,
                v_tail=v_tail,
                sm_scale=sm_scale,
            )
    return kivi_decode_attention_ref(
        q,
        k_packed,
        k_scale,
        k_mn,
        v_packed,
        v_scale,
        v_mn,
        bits=bits,
        k_group=k_group,
        v_group=v_group,
        v_bits=v_bits,
        k_tail=k_tail,
        v_tail=v_tail,
        sm_scale=sm_scale,
    )
