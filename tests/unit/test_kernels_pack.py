"""pack_bits / unpack_bits dispatch (CPU path = reference) against an independent bit-stream model."""

import pytest
import torch

from vericache_kernels import pack_bits, pack_bits_ref, pad_multiple, unpack_bits, unpack_bits_float, unpack_bits_ref


def _pack_python(codes: list[int], bits: int) -> list[int]:
    """Literal reading of the format: code j occupies stream bits [j*bits, (j+1)*bits), LSB first."""
    stream = 0
    for j, c in enumerate(codes):
        stream |= c << (j * bits)
    return [(stream >> (8 * i)) & 0xFF for i in range(len(codes) * bits // 8)]


@pytest.mark.parametrize("bits", range(1, 9))
def test_matches_python_bitstream(bits):
    g = torch.Generator().manual_seed(bits)
    n = pad_multiple(bits) * 5
    codes = torch.randint(0, 2**bits, (3, n), generator=g, dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    for row in range(3):
        assert packed[row].tolist() == _pack_python(codes[row].tolist(), bits)


def test_known_bytes():
    # 2 bits: codes 1,2,3,0 -> 0b00_11_10_01 ; 4 bits: 0xA, 0x5 -> 0x5A ; 3 bits: 5, 3, 7 + pad
    assert pack_bits(torch.tensor([1, 2, 3, 0], dtype=torch.uint8), 2).tolist() == [0b00111001]
    assert pack_bits(torch.tensor([0xA, 0x5], dtype=torch.uint8), 4).tolist() == [0x5A]
    c3 = torch.tensor([5, 3, 7, 0, 0, 0, 0, 1], dtype=torch.uint8)
    assert pack_bits(c3, 3).tolist() == _pack_python(c3.tolist(), 3)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("rows", [1, 63, 500])
def test_roundtrip_odd_sizes(bits, rows):
    g = torch.Generator().manual_seed(rows * 10 + bits)
    n = pad_multiple(bits) * 3
    codes = torch.randint(0, 2**bits, (rows, 2, n), generator=g, dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, 2, n * bits // 8)
    assert torch.equal(packed, pack_bits_ref(codes, bits))
    out = unpack_bits(packed, bits, n)
    assert torch.equal(out, codes)
    assert torch.equal(out, unpack_bits_ref(packed, bits, n))


@pytest.mark.parametrize("bits", [0, 9, 2.0])
def test_bad_bits(bits):
    with pytest.raises(ValueError, match="bits"):
        pack_bits(torch.zeros(8, dtype=torch.uint8), bits)
    with pytest.raises(ValueError, match="bits"):
        unpack_bits(torch.zeros(8, dtype=torch.uint8), bits, 8)


def test_bad_lengths():
    with pytest.raises(ValueError, match="whole bytes"):
        pack_bits(torch.zeros(5, dtype=torch.uint8), 3)  # 15 bits
    with pytest.raises(ValueError, match="expected 2 bytes"):
        unpack_bits(torch.zeros(3, dtype=torch.uint8), 2, 8)
    with pytest.raises(ValueError, match="backend"):
        pack_bits(torch.zeros(8, dtype=torch.uint8), 2, backend="cuda")


@pytest.mark.parametrize("bits", range(1, 9))
def test_unpack_float_and_table(bits):
    g = torch.Generator().manual_seed(bits)
    n = pad_multiple(bits) * 4
    codes = torch.randint(0, 2**bits, (5, 7, n), generator=g, dtype=torch.uint8)
    packed = pack_bits_ref(codes, bits)
    out = unpack_bits_float(packed, bits, n)
    assert out.dtype == torch.float32 and torch.equal(out, codes.float())
    table = torch.randn(2**bits, generator=g)
    assert torch.equal(unpack_bits_float(packed, bits, n, values=table), table[codes.long()])
    with pytest.raises(ValueError, match="entries"):
        unpack_bits_float(packed, bits, n, values=torch.zeros(2**bits + 1))
