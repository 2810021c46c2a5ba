"""Bit-packing of small integer codes into bytes (torch reference).

Format (shared by every compressor and kernel): codes of ``bits`` bits along the last dim form one
little-endian bit stream; code j occupies stream bits [j*bits, (j+1)*bits) and byte i holds stream
bits [8i, 8i+8), least significant bit first. For bits in {1, 2, 4, 8} code j therefore sits in
byte (j*bits)//8 at shift (j*bits)%8; for 3, 5, 6, 7 bits a code may straddle two bytes.
The last dim must be a multiple of 8 // gcd(8, bits) so that it packs into whole bytes.
"""

from __future__ import annotations

import math

import torch


def packed_len(n: int, bits: int) -> int:
    """Bytes that n codes of `bits` bits take."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    if (n * bits) % 8:
        raise ValueError(f"{n} codes of {bits} bits do not fill whole bytes")
    return n * bits // 8


def pack_bits_ref(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes [..., n] (each < 2**bits) into uint8 bytes [..., n*bits/8]."""
    n = codes.shape[-1]
    nbytes = packed_len(n, bits)
    if bits == 8:
        return codes.to(torch.uint8).contiguous()
    if 8 % bits == 0:  # fast path: whole codes per byte, OR-ed in uint8 (a sum over a 2-4 wide dim is slow)
        per = 8 // bits
        c = codes.to(torch.uint8).reshape(*codes.shape[:-1], nbytes, per)
        out = c[..., 0].clone()
        for j in range(1, per):
            out |= c[..., j] << (j * bits)
        return out
    # general path: expand to a bit stream, regroup by 8
    shifts = torch.arange(bits, device=codes.device, dtype=torch.int32)
    stream = (codes.to(torch.int32).unsqueeze(-1) >> shifts) & 1  # [..., n, bits]
    stream = stream.reshape(*codes.shape[:-1], nbytes, 8)
    weights = torch.arange(8, device=codes.device, dtype=torch.int32)
    return (stream << weights).sum(-1).to(torch.uint8)


def unpack_bits_ref(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of pack_bits_ref: uint8 bytes [..., n*bits/8] -> uint8 codes [..., n]."""
    nbytes = packed_len(n, bits)
    if packed.shape[-1] != nbytes:
        raise ValueError(f"expected {nbytes} bytes for {n} codes of {bits} bits, got {packed.shape[-1]}")
    if bits == 8:
        return packed
    if 8 % bits == 0:
        per, mask = 8 // bits, (1 << bits) - 1
        codes = torch.empty(*packed.shape, per, dtype=torch.uint8, device=packed.device)
        for j in range(per):
            torch.bitwise_and(packed >> (j * bits), mask, out=codes[..., j])
        return codes.reshape(*packed.shape[:-1], n)
    p = packed.to(torch.int32)
    weights = torch.arange(8, device=packed.device, dtype=torch.int32)
    stream = ((p.unsqueeze(-1) >> weights) & 1).reshape(*packed.shape[:-1], n, bits)
    shifts = torch.arange(bits, device=packed.device, dtype=torch.int32)
    return (stream << shifts).sum(-1).to(torch.uint8)


def pad_multiple(bits: int) -> int:
    """Smallest count of codes that packs into whole bytes."""
    return 8 // math.gcd(8, bits)
