"""Triton dequantization of KIVI-format codes with a fused RoPE or rotation (imported lazily by
kernels.kvquant / kernels.rotatekv; needs triton).

One program dequantizes BLOCK_R rows of D channels (rows = the flattened [..., T] of a [..., T, D]
tensor). Codes are a little-endian bit stream per row (kernels/bitpack.py): channel d sits at stream
bits [d*BITS, (d+1)*BITS), possibly straddling two bytes. Affine (KIVI's format, float32 math):
    x[r, d] = code[r, d] * scale[r // ROWS_PER_SCALE, d // CH_PER_SCALE] + mn[same]
Then, when ROPE, rotate by the row's position p = pos0 + r % T (the model's rotate-half RoPE):
    out[d] = x[d] cos(p f_{d mod D/2}) + sign(d) x[(d + D/2) mod D] sin(p f_{d mod D/2}),
    sign = -1 for d < D/2, +1 otherwise;
and when ROTATE, multiply by the orthogonal matrix R [D, D]: out = x @ R (fp32, no TF32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_R = 32


@triton.jit
def _dequant(
    P, S, M, r, rmask, d, nbytes_row, rows_per_scale, n_cgroups, BITS: tl.constexpr, CH_PER_SCALE: tl.constexpr
):
    bit0 = d * BITS
    lo = bit0 // 8
    sh = bit0 % 8
    base = r[:, None] * nbytes_row
    word = tl.load(P + base + lo[None, :], mask=rmask[:, None], other=0).to(tl.int32)
    if 8 % BITS != 0:  # a code may straddle into the next byte
        straddle = (lo + 1 < nbytes_row) & (sh + BITS > 8)
        hi = tl.load(P + base + lo[None, :] + 1, mask=rmask[:, None] & straddle[None, :], other=0).to(tl.int32)
        word = word | (hi << 8)
    code = ((word >> sh[None, :]) & ((1 << BITS) - 1)).to(tl.float32)
    sidx = (r // rows_per_scale)[:, None] * n_cgroups + (d // CH_PER_SCALE)[None, :]
    s = tl.load(S + sidx, mask=rmask[:, None], other=0.0).to(tl.float32)
    m = tl.load(M + sidx, mask=rmask[:, None], other=0.0).to(tl.float32)
    return code * s + m


@triton.jit
def _dequant_kernel(
    P,
    S,
    M,
    INV,
    RM,
    O,
    rows,
    nbytes_row,
    T,
    pos0,
    rows_per_scale,
    n_cgroups,
    BITS: tl.constexpr,
    D: tl.constexpr,
    CH_PER_SCALE: tl.constexpr,
    ROPE: tl.constexpr,
    ROTATE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    rmask = r < rows
    d = tl.arange(0, D)
    x = _dequant(P, S, M, r, rmask, d, nbytes_row, rows_per_scale, n_cgroups, BITS, CH_PER_SCALE)
    if ROPE:
        half = D // 2
        xp = _dequant(P, S, M, r, rmask, (d + half) % D, nbytes_row, rows_per_scale, n_cgroups, BITS, CH_PER_SCALE)
        pos = (r % T + pos0).to(tl.float32)
        f = tl.load(INV + d % half)
        ang = pos[:, None] * f[None, :]
        sign = tl.where(d < half, -1.0, 1.0)
        x = x * tl.cos(ang) + sign[None, :] * xp * tl.sin(ang)
    if ROTATE:
        rot = tl.load(RM + d[:, None] * D + d[None, :])
        x = tl.dot(x, rot, input_precision="ieee")
    tl.store(O + r[:, None] * D + d[None, :], x, mask=rmask[:, None])


def triton_dequant_supported(d: int) -> bool:
    """D must be a power of two (tl.arange) and >= 16 (tl.dot)."""
    return d >= 16 and d & (d - 1) == 0


def dequant_rows_triton(
    packed: torch.Tensor,
    scale: torch.Tensor,
    mn: torch.Tensor,
    bits: int,
    d: int,
    rows_per_scale: int,
    ch_per_scale: int,
    inv_freq: torch.Tensor | None = None,
    pos0: int = 0,
    rot: torch.Tensor | None = None,
) -> torch.Tensor:
    """packed [..., T, D*bits/8] -> float32 [..., T, D] (see the module doc)."""
    *lead, t, nb = packed.shape
    rows = packed.numel() // nb if nb else 0
    out = torch.empty(*lead, t, d, dtype=torch.float32, device=packed.device)
    if rows == 0:
        return out
    dummy = torch.zeros(1, dtype=torch.float32, device=packed.device)
    inv = inv_freq.float().contiguous() if inv_freq is not None else dummy
    rm = rot.float().contiguous() if rot is not None else dummy
    _dequant_kernel[(triton.cdiv(rows, BLOCK_R),)](
        packed.contiguous(),
        scale.contiguous(),
        mn.contiguous(),
        inv,
        rm,
        out,
        rows,
        nb,
        t,
        pos0,
        rows_per_scale,
        d // ch_per_scale,
        BITS=bits,
        D=d,
        CH_PER_SCALE=ch_per_scale,
        ROPE=inv_freq is not None,
        ROTATE=rot is not None,
        BLOCK=BLOCK_R,
    )
    return out
