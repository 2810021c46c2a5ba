"""split16 (compressors/split16.py): the compressed copy is each float32 value's upper 16 bits, its
complement the lower 16; joined they are the KV bit for bit. Checked against plain bit arithmetic."""

from __future__ import annotations

import struct

import pytest
import torch

from vericache_connector.compressors import LayeredKV, PrefixKV, get_compressor
from vericache_connector.compressors.split16 import COMPLEMENT, digest, join, split

SPECIALS = [0.0, -0.0, 1.0, -1.0, 1e-40, -1e-40, 3.4e38, -3.4e38, float("inf"), float("-inf"), 65504.0, -2.5e-3]


def prefix(t: int = 70, layers: int = 3, seed: int = 0) -> PrefixKV:
    g = torch.Generator().manual_seed(seed)
    keys = [
        torch.randn(2, t, 16, generator=g) * 10 ** torch.randint(-6, 6, (2, t, 1), generator=g) for _ in range(layers)
    ]
    values = [torch.randn(2, t, 16, generator=g) for _ in range(layers)]
    keys[0][0, 0, : len(SPECIALS)] = torch.tensor(SPECIALS)
    return PrefixKV(keys, values)


def bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def test_halves_are_the_upper_and_lower_16_bits():
    x = torch.tensor(SPECIALS + [float(v) for v in torch.randn(50)], dtype=torch.float32)
    hi, lo = split(x)
    assert hi.dtype == lo.dtype == torch.int16
    for v, h, lw in zip(x.tolist(), hi.tolist(), lo.tolist()):
        b = bits(v)
        assert (h & 0xFFFF, lw & 0xFFFF) == (b >> 16, b & 0xFFFF)
    assert torch.equal(join(hi, lo).view(torch.int32), x.view(torch.int32))  # bit for bit (-0.0, inf too)
    nan = torch.tensor([float("nan")])
    assert torch.equal(join(*split(nan)).view(torch.int32), nan.view(torch.int32))


def test_upper_half_attends_as_truncated_bfloat16():
    pre = prefix()
    c = get_compressor("split16").compress(pre)
    assert c.nbytes * 2 == pre.nbytes  # half the float32 copy's bytes
    k, v = c.layer_kv(1, torch.float32)
    want = (pre.keys[1].view(torch.int32) & ~0xFFFF).view(torch.float32)  # truncation, not rounding
    assert torch.equal(k, want)
    assert torch.allclose(v, pre.values[1], rtol=2**-7, atol=0)
    get_compressor("split16").validate(c, 70, 3, 2, 16)


def test_complement_joins_to_the_prefix_bit_for_bit():
    pre, c16 = prefix(), get_compressor("split16")
    hi, lo = c16.halves(pre)
    assert all(torch.equal(x[n], y[n]) for x, y in zip(hi.layers, c16.compress(pre).layers) for n in ("k", "v"))
    assert hi.meta == c16.compress(pre).meta and lo.spec == hi.spec + COMPLEMENT and lo.meta["hi"] == digest(hi.layers)
    back = LayeredKV.from_payload(*lo.to_payload())  # as a store returns it
    for (k, v), k0, v0 in zip(c16.full_layers(hi, back), pre.keys, pre.values):
        assert torch.equal(k.view(torch.int32), k0.view(torch.int32)) and torch.equal(v, v0)
    with pytest.raises(ValueError, match="not attendable"):
        back.layer_kv(0, torch.float32)


def test_a_complement_of_other_kv_is_refused():
    c16 = get_compressor("split16")
    a, b = prefix(seed=1), prefix(seed=2)
    (hi_a, lo), (_, lo_b) = c16.halves(a), c16.halves(b)
    with pytest.raises(ValueError, match="digest differs"):
        c16.full_layers(hi_a, lo_b)
    with pytest.raises(ValueError, match="other prefix"):
        c16.full_layers(hi_a, c16.halves(prefix(t=69))[1])
    with pytest.raises(ValueError, match="not a split16 complement"):
        c16.full_layers(hi_a, hi_a)
    lo.layers[1]["v"] = lo.layers[1]["v"][:, :-1]
    with pytest.raises(ValueError, match="complement layer 1 'v'"):
        c16.full_layers(hi_a, lo)


def test_only_float32_splits():
    with pytest.raises(ValueError, match="float32"):
        split(torch.zeros(3, dtype=torch.bfloat16))
