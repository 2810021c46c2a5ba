"""RotateKV-style quantization (Su et al. 2025; QuaRot's rotation): Hadamard-rotate each K/V row,
then quantize it per token at low bit width. The single source of truth for the format.

A row x in R^D (D a power of two) is rotated by the orthogonal R = H_D diag(s) / sqrt(D): H_D the
Sylvester Hadamard matrix, s a seeded random +-1 vector (a randomized Hadamard transform). A few large
channels (the outliers that make per-token low-bit quantization fail on keys) are spread evenly over all
D rotated channels, so a per-token asymmetric quantizer over runs of `group` channels works for keys
too:
    y = x R^T;   codes, scale, mn = KIVI value format of y (kivi.py: per token, groups of `group`
    channels, scale/mn float16 [..., T, D/group], codes bit-packed along D)
    x_hat = dequant(y) R                                      (float32 math; R^T R = I)
The Triton path fuses the unpacking, the affine and the rotation back (kernels/_quant_triton.py).
"""

from __future__ import annotations

import functools

import torch

from ._dispatch import use_triton
from .kivi import kivi_dequantize_values, kivi_quantize_values

Tensor = torch.Tensor


@functools.lru_cache(maxsize=16)
def _rotation_cpu(d: int, seed: int) -> Tensor:
    if d < 1 or d & (d - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two head dim, got {d}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:  # Sylvester: H_2n = [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (d,), generator=gen, dtype=torch.float64) * 2 - 1
    return (h * signs[None, :] / d**0.5).float()


def hadamard_rotation(d: int, seed: int = 0, device="cpu") -> Tensor:
    """R [D, D] float32 = H_D diag(s) / sqrt(D), orthogonal (R R^T = I)."""
    return _rotation_cpu(d, seed).to(device)


def rotatekv_quantize(x: Tensor, bits: int, group: int, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """x [..., T, D] -> (packed uint8 [..., T, D*bits/8], scale fp16 [..., T, D/group], mn fp16 same)."""
    r = hadamard_rotation(x.shape[-1], seed, x.device)
    return kivi_quantize_values(x.float() @ r.T, bits, group)


def rotatekv_dequantize_ref(packed: Tensor, scale: Tensor, mn: Tensor, bits: int, group: int, seed: int = 0) -> Tensor:
    """Reference: dequant(codes) R -> float32 [..., T, D]."""
    y = kivi_dequantize_values(packed, scale, mn, bits, group)
    return y @ hadamard_rotation(y.shape[-1], seed, y.device)


def rotatekv_dequantize(
    packed: Tensor,
    scale: Tensor,
    mn: Tensor,
    bits: int,
    group: int,
    seed: int = 0,
    dtype=torch.float32,
    backend: str = "auto",
) -> Tensor:
    """Inverse of rotatekv_quantize -> [..., T, D] in dtype (Triton: unpack, affine, rotate in one kernel)."""
    d = packed.shape[-1] * 8 // bits
    if packed.shape[-2] and use_triton(backend, packed, scale):
        from ._quant_triton import dequant_rows_triton, triton_dequant_supported

        if triton_dequant_supported(d):
            rot = hadamard_rotation(d, seed, packed.device)
            return dequant_rows_triton(packed, scale, mn, bits, d, 1, group, rot=rot).to(dtype)
    return rotatekv_dequantize_ref(packed, scale, mn, bits, group, seed).to(dtype)
