"""pack_bits / unpack_bits: dispatch between the torch reference (bitpack.py) and Triton.

The format is the one documented in ``kernels/bitpack.py`` (little-endian bit stream along the last
dim). Because every row packs into whole bytes, the rows of a contiguous tensor concatenate into one
continuous stream, so the Triton kernels work on the flattened tensor: byte i holds stream bits
[8i, 8i+8) and code j occupies stream bits [j*bits, (j+1)*bits).
"""

from __future__ import annotations

import torch

from ._dispatch import use_triton
from .bitpack import pack_bits_ref, packed_len, unpack_bits_ref


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an int in 1..8, got {bits!r}")


def pack_bits(codes: torch.Tensor, bits: int, *, backend: str = "auto") -> torch.Tensor:
    """Pack uint8 codes [..., n] (each < 2**bits) into uint8 bytes [..., n*bits/8]."""
    _check_bits(bits)
    packed_len(codes.shape[-1], bits)  # validates whole bytes
    if use_triton(backend, codes):
        from ._pack_triton import pack_bits_triton

        return pack_bits_triton(codes, bits)
    return pack_bits_ref(codes, bits)


def unpack_bits(packed: torch.Tensor, bits: int, n: int, *, backend: str = "auto") -> torch.Tensor:
    """Inverse of pack_bits: uint8 bytes [..., n*bits/8] -> uint8 codes [..., n]."""
    _check_bits(bits)
    nbytes = packed_len(n, bits)
    if packed.shape[-1] != nbytes:
        raise ValueError(f"expected {nbytes} bytes for {n} codes of {bits} bits, got {packed.shape[-1]}")
    if use_triton(backend, packed):
        from ._pack_triton import unpack_bits_triton

        return unpack_bits_triton(packed, bits, n)
    return unpack_bits_ref(packed, bits, n)


def unpack_bits_float(packed: torch.Tensor, bits: int, n: int, values: torch.Tensor | None = None) -> torch.Tensor:
    """Codes of packed [..., n*bits/8] as float32 [..., n], or values[code] when a float table of
    2**bits entries is given (a codebook). Same result as unpack_bits(...).float() / values[codes],
    faster on CPU: uint8 shifts for bits in {1, 2, 4, 8}, one 256-entry byte table for lookups."""
    _check_bits(bits)
    nbytes = packed_len(n, bits)
    if packed.shape[-1] != nbytes:
        raise ValueError(f"expected {nbytes} bytes for {n} codes of {bits} bits, got {packed.shape[-1]}")
    if values is not None and values.shape != (1 << bits,):
        raise ValueError(f"values must have {1 << bits} entries, got {tuple(values.shape)}")
    if 8 % bits:
        codes = unpack_bits_ref(packed, bits, n)
        return codes.float() if values is None else values.float()[codes.long()]
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    if values is None:
        if bits == 8:
            return packed.float()
        # code k of a byte = (byte >> k*bits) & mask; the 8/bits codes of a byte are adjacent along n
        mask = (1 << bits) - 1
        parts = [(packed >> (k * bits)) & mask if k else packed & mask for k in range(8 // bits)]
        return torch.stack(parts, -1).reshape(*packed.shape[:-1], n).float()
    # table[byte, k] = values[code k of byte]; one gather per byte gives 8/bits values
    table = values.float()[
        (
            (torch.arange(256, device=packed.device, dtype=torch.uint8).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
        ).long()
    ]
    return table.index_select(0, packed.reshape(-1).int()).reshape(*packed.shape[:-1], n)
