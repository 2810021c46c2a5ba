"""Triton pack/unpack kernels (imported lazily by kernels.pack; needs triton).

Both kernels treat the contiguous tensor as one flat bit stream (see kernels/bitpack.py).
For bits in {1, 2, 4, 8} a byte holds 8/bits whole codes; otherwise a code may straddle two bytes.
Codes >= 2**bits are masked to their low bits (the contract is codes < 2**bits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .bitpack import packed_len

_BLOCK = 1024


@triton.jit
def _pack_kernel(C, P, nbytes, BITS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # output byte index
    m = offs < nbytes
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    if 8 % BITS == 0:
        # byte i = sum_k code[i*per + k] << (k*bits), per = 8 // bits
        for k in tl.static_range(8 // BITS):
            c = tl.load(C + offs * (8 // BITS) + k, mask=m, other=0).to(tl.int32)
            acc |= (c & ((1 << BITS) - 1)) << (k * BITS)
    else:
        # byte i, bit b = stream bit p = 8i + b = bit (p % bits) of code p // bits
        for b in tl.static_range(8):
            p = offs * 8 + b
            c = tl.load(C + p // BITS, mask=m, other=0).to(tl.int32)
            acc |= ((c >> (p % BITS).to(tl.int32)) & 1) << b
    tl.store(P + offs, acc.to(tl.uint8), mask=m)


@triton.jit
def _unpack_kernel(P, C, ncodes, nbytes, BITS: tl.constexpr, BLOCK: tl.constexpr):
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # output code index
    m = j < ncodes
    bit0 = j * BITS
    lo = bit0 // 8
    sh = (bit0 % 8).to(tl.int32)
    word = tl.load(P + lo, mask=m, other=0).to(tl.int32)
    if 8 % BITS != 0:
        # the code straddles into the next byte when sh + bits > 8
        hi = tl.load(P + lo + 1, mask=m & (lo + 1 < nbytes) & (sh + BITS > 8), other=0).to(tl.int32)
        word |= hi << 8
    tl.store(C + j, ((word >> sh) & ((1 << BITS) - 1)).to(tl.uint8), mask=m)


def pack_bits_triton(codes: torch.Tensor, bits: int) -> torch.Tensor:
    nb_row = packed_len(codes.shape[-1], bits)
    c = codes.contiguous()
    if c.dtype != torch.uint8:
        c = c.to(torch.uint8)
    out = torch.empty(*codes.shape[:-1], nb_row, dtype=torch.uint8, device=codes.device)
    nbytes = out.numel()
    if nbytes:
        _pack_kernel[(triton.cdiv(nbytes, _BLOCK),)](c, out, nbytes, BITS=bits, BLOCK=_BLOCK)
    return out


def unpack_bits_triton(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    p = packed.contiguous()
    out = torch.empty(*packed.shape[:-1], n, dtype=torch.uint8, device=packed.device)
    ncodes = out.numel()
    if ncodes:
        _unpack_kernel[(triton.cdiv(ncodes, _BLOCK),)](p, out, ncodes, p.numel(), BITS=bits, BLOCK=_BLOCK)
    return out
