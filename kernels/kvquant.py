"""KVQuant-style quantization (Hooper et al. 2024): pre-RoPE per-channel keys, per-token values,
dense-and-sparse outliers. The single source of truth for the format; the codes are KIVI's (kivi.py).

Keys [..., T, D] arrive rotated by RoPE at positions pos0 .. pos0 + T - 1. RoPE mixes channel d with
d +- D/2 at a position-dependent angle, which smears the per-channel outlier structure, so the keys are
un-rotated first (pre = RoPE^-1(k)) and quantized per channel over all T tokens:
  * dense-and-sparse: per channel the m smallest and m largest pre-RoPE values are outliers
    (m = outliers per side); the channel's range is [m-th smallest, m-th largest], values are clamped
    to it and quantized asymmetrically at `bits` (KIVI key format with one group of all T tokens:
    scale/mn float16 [..., 1, D], codes bit-packed along D);
  * each outlier stores its position (int32 [..., 2m, D], token index per channel) and its residual
    delta = pre - dequant(code) (float16), so pre ~= dequant(code) + delta exactly there;
  * dequantized keys: k_hat = RoPE(dense + scatter(delta)) at the same positions.
Values [..., T, D]: the same per token (one group of D channels; outlier positions are channel
indices int32 [..., T, 2m]), no RoPE.

The Triton path dequantizes the dense part with the RoPE fused (kernels/_quant_triton.py) and adds the
rotated sparse part in torch: RoPE is linear, RoPE(dense + sparse) = RoPE(dense) + RoPE(sparse).
"""

from __future__ import annotations

import torch

from ._dispatch import use_triton
from .kivi import kivi_dequantize_keys, kivi_dequantize_values, kivi_quantize_keys, kivi_quantize_values

Tensor = torch.Tensor


def _cos_sin(t: int, inv_freq: Tensor, pos0: int, device) -> tuple[Tensor, Tensor]:
    """cos/sin [T, D] of the model's rotate-half RoPE at positions pos0 .. pos0 + T - 1 (float32)."""
    freqs = torch.arange(pos0, pos0 + t, device=device, dtype=torch.float32)[:, None] * inv_freq.float().to(device)
    emb = torch.cat((freqs, freqs), -1)
    return emb.cos(), emb.sin()


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(x: Tensor, inv_freq: Tensor, pos0: int = 0) -> Tensor:
    """x [..., T, D] (float32) rotated to positions pos0..: x cos + rotate_half(x) sin."""
    cos, sin = _cos_sin(x.shape[-2], inv_freq, pos0, x.device)
    return x * cos + _rotate_half(x) * sin


def unrope(x: Tensor, inv_freq: Tensor, pos0: int = 0) -> Tensor:
    """Inverse of rope: rotation by the negative angle, x cos - rotate_half(x) sin."""
    cos, sin = _cos_sin(x.shape[-2], inv_freq, pos0, x.device)
    return x * cos - _rotate_half(x) * sin


def _split_outliers(x: Tensor, m: int, dim: int) -> tuple[Tensor, Tensor]:
    """Clamp x to [m-th smallest, m-th largest] along dim; positions of the 2m outliers along dim."""
    n = x.shape[dim]
    if m == 0:
        shape = list(x.shape)
        shape[dim] = 0
        return x, torch.zeros(shape, dtype=torch.long, device=x.device)
    if 2 * m >= n:
        raise ValueError(f"{2 * m} outliers leave nothing to quantize in {n} entries")
    srt, order = x.sort(dim=dim)
    lo, hi = srt.narrow(dim, m, 1), srt.narrow(dim, n - 1 - m, 1)
    pos = torch.cat([order.narrow(dim, 0, m), order.narrow(dim, n - m, m)], dim)
    return torch.minimum(torch.maximum(x, lo), hi), pos


def kvquant_quantize_keys(k: Tensor, inv_freq: Tensor, bits: int, outliers: int, pos0: int = 0) -> dict[str, Tensor]:
    """K [..., T, D] post-RoPE -> {packed, scale, mn (KIVI key format, group T), out_pos, out_val}."""
    t, d = k.shape[-2:]
    if inv_freq.shape != (d // 2,):
        raise ValueError(f"inv_freq must have head_dim/2 = {d // 2} entries, got {tuple(inv_freq.shape)}")
    pre = unrope(k.float(), inv_freq, pos0)
    clamped, pos = _split_outliers(pre, outliers, -2)
    packed, scale, mn = kivi_quantize_keys(clamped, bits, t)
    dense = kivi_dequantize_keys(packed, scale, mn, bits, t)
    delta = (pre - dense).gather(-2, pos).to(torch.float16)
    return {"packed": packed, "scale": scale, "mn": mn, "out_pos": pos.to(torch.int32), "out_val": delta}


def kvquant_quantize_values(v: Tensor, bits: int, outliers: int) -> dict[str, Tensor]:
    """V [..., T, D] -> {packed, scale, mn (KIVI value format, group D), out_pos, out_val}."""
    d = v.shape[-1]
    x = v.float()
    clamped, pos = _split_outliers(x, outliers, -1)
    packed, scale, mn = kivi_quantize_values(clamped, bits, d)
    dense = kivi_dequantize_values(packed, scale, mn, bits, d)
    delta = (x - dense).gather(-1, pos).to(torch.float16)
    return {"packed": packed, "scale": scale, "mn": mn, "out_pos": pos.to(torch.int32), "out_val": delta}


def _sparse(shape, pos: Tensor, val: Tensor, dim: int, device) -> Tensor:
    return torch.zeros(shape, dtype=torch.float32, device=device).scatter_(dim, pos.long(), val.float())


def kvquant_dequantize_keys_ref(q: dict[str, Tensor], inv_freq: Tensor, bits: int, pos0: int = 0) -> Tensor:
    """Reference: RoPE(dense + scatter(delta)) -> float32 [..., T, D]."""
    t = q["packed"].shape[-2]
    dense = kivi_dequantize_keys(q["packed"], q["scale"], q["mn"], bits, t)
    return rope(dense + _sparse(dense.shape, q["out_pos"], q["out_val"], -2, dense.device), inv_freq, pos0)


def kvquant_dequantize_keys(
    q: dict[str, Tensor], inv_freq: Tensor, bits: int, pos0: int = 0, dtype=torch.float32, backend: str = "auto"
) -> Tensor:
    """Dequantized post-RoPE keys [..., T, D] in dtype (Triton: dense part with fused RoPE)."""
    p = q["packed"]
    d = p.shape[-1] * 8 // bits
    if p.shape[-2] and use_triton(backend, p, q["scale"]):
        from ._quant_triton import dequant_rows_triton, triton_dequant_supported

        if triton_dequant_supported(d):
            out = dequant_rows_triton(p, q["scale"], q["mn"], bits, d, p.shape[-2], 1, inv_freq=inv_freq, pos0=pos0)
            sparse = _sparse(out.shape, q["out_pos"], q["out_val"], -2, out.device)
            return (out + rope(sparse, inv_freq, pos0)).to(dtype)
    return kvquant_dequantize_keys_ref(q, inv_freq, bits, pos0).to(dtype)


def kvquant_dequantize_values(q: dict[str, Tensor], bits: int, dtype=torch.float32, backend: str = "auto") -> Tensor:
    """Dequantized values [..., T, D] in dtype: dense + scatter(delta)."""
    p = q["packed"]
    d = p.shape[-1] * 8 // bits
    if p.shape[-2] and use_triton(backend, p, q["scale"]):
        from ._quant_triton import dequant_rows_triton, triton_dequant_supported

        if triton_dequant_supported(d):
            dense = dequant_rows_triton(p, q["scale"], q["mn"], bits, d, 1, d)
            return (dense + _sparse(dense.shape, q["out_pos"], q["out_val"], -1, dense.device)).to(dtype)
    dense = kivi_dequantize_values(p, q["scale"], q["mn"], bits, d)
    return (dense + _sparse(dense.shape, q["out_pos"], q["out_val"], -1, dense.device)).to(dtype)
