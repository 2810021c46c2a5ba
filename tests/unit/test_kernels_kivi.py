"""KIVI format (kernels/kivi.py): quantizer round trip, stored-format invariants, decode attention."""

import pytest
import torch

from vericache_kernels import (
    kivi_decode_attention,
    kivi_decode_attention_ref,
    kivi_dequantize_keys,
    kivi_dequantize_values,
    kivi_quantize_keys,
    kivi_quantize_values,
    kivi_split,
    unpack_bits,
)

SLACK = 1e-6  # fp32 rounding of code*scale + mn


def _rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * 2 + 0.5
    x[..., 3] *= 20  # an outlier channel, as in real keys
    return x.to(dtype)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_keys_roundtrip_within_half_scale(bits, dtype):
    k = _rand(3, 64, 16, dtype=dtype, seed=bits)
    packed, scale, mn = kivi_quantize_keys(k, bits, 32)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 64, 16 * bits // 8)
    assert scale.dtype == mn.dtype == torch.float16 and scale.shape == mn.shape == (3, 2, 16)
    back = kivi_dequantize_keys(packed, scale, mn, bits, 32)
    assert back.dtype == torch.float32 and back.shape == k.shape
    s = scale.float().repeat_interleave(32, dim=1)
    err = (back - k.float()).abs()
    assert (err <= s / 2 + SLACK * (1 + k.float().abs())).all(), (err - s / 2).max()


@pytest.mark.parametrize("bits", range(1, 9))
def test_values_roundtrip_within_half_scale(bits):
    v = _rand(2, 63, 32, seed=bits)  # T = 63: values need no token grouping
    packed, scale, mn = kivi_quantize_values(v, bits, 16)
    assert packed.shape == (2, 63, 32 * bits // 8) and scale.shape == mn.shape == (2, 63, 2)
    back = kivi_dequantize_values(packed, scale, mn, bits, 16, dtype=torch.float16)
    assert back.dtype == torch.float16
    back = kivi_dequantize_values(packed, scale, mn, bits, 16)
    s = scale.float().repeat_interleave(16, dim=-1)
    assert ((back - v).abs() <= s / 2 + SLACK * (1 + v.abs())).all()


def test_stored_format_is_the_documented_math():
    """codes = round((x - mn)/scale) clamped with the *stored* fp16 scale/mn, and the range is covered."""
    k = _rand(2, 64, 8, seed=7)
    bits, grp = 3, 16
    packed, scale, mn = kivi_quantize_keys(k, bits, grp)
    codes = unpack_bits(packed, bits, 8).float()  # [2, 64, 8]
    s = scale.float().repeat_interleave(grp, 1)
    m = mn.float().repeat_interleave(grp, 1)
    want = torch.round((k - m) / s).clamp(0, 2**bits - 1)
    assert torch.equal(codes, want)
    assert torch.equal(kivi_dequantize_keys(packed, scale, mn, bits, grp), codes * s + m)
    kg = k.reshape(2, 4, grp, 8)
    assert (mn.float() <= kg.amin(2)).all()  # mn rounded down
    assert (mn.float() + (2**bits - 1) * scale.float() >= kg.amax(2) - 1e-5).all()


def test_constant_group_is_exact_and_zero_scale():
    k = torch.full((1, 32, 8), 0.125)  # fp16-representable: mn is exact, scale 0
    v = torch.full((1, 5, 8), -3.5)
    kp, ks, km = kivi_quantize_keys(k, 2, 32)
    vp, vs, vm = kivi_quantize_values(v, 2, 8)
    assert (ks == 0).all() and (vs == 0).all()
    assert torch.equal(kivi_dequantize_keys(kp, ks, km, 2, 32), k)
    assert torch.equal(kivi_dequantize_values(vp, vs, vm, 2, 8), v)
    # not representable: mn rounds down, a tiny scale covers the gap, error still <= scale/2
    k = torch.full((1, 32, 8), 0.1234)
    kp, ks, km = kivi_quantize_keys(k, 2, 32)
    assert (ks.float() < 1e-4).all()
    assert ((kivi_dequantize_keys(kp, ks, km, 2, 32) - k).abs() <= ks.float() / 2 + 1e-7).all()


def test_kivi_split():
    assert kivi_split(4097, 32) == 4096
    assert kivi_split(4097, 32, min_residual=128) == 3968
    assert kivi_split(20, 32) == 0
    with pytest.raises(ValueError):
        kivi_split(10, 0)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="multiple of group"):
        kivi_quantize_keys(torch.zeros(1, 63, 8), 2, 32)
    with pytest.raises(ValueError, match="multiple of group"):
        kivi_quantize_values(torch.zeros(1, 4, 24), 2, 16)
    with pytest.raises(ValueError, match="pack into bytes"):
        kivi_quantize_keys(torch.zeros(1, 32, 4), 3, 32)
    with pytest.raises(ValueError, match="bits"):
        kivi_quantize_keys(torch.zeros(1, 32, 8), 9, 32)
    kp, ks, km = kivi_quantize_keys(torch.zeros(1, 64, 8), 2, 32)
    with pytest.raises(ValueError, match="do not match"):
        kivi_dequantize_keys(kp, ks, km, 2, 16)


# ---- decode attention --------------------------------------------------------------------------

from attention_oracle import oracle  # noqa: E402


@pytest.mark.parametrize("t_total,lq,batch", [(64, 1, None), (500, 4, 2), (4097, 1, 1), (4097, 3, None)])
@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_decode_attention_matches_oracle(t_total, lq, batch, bits, monkeypatch):
    import vericache_kernels.kivi as kivi_mod

    monkeypatch.setattr(kivi_mod, "block_tokens", lambda *a: 64)  # several dequantized blocks
    g = torch.Generator().manual_seed(t_total + bits)
    lead = () if batch is None else (batch,)
    hq, hkv, d, grp = 6, 2, 32, 32
    k, v = torch.randn(*lead, hkv, t_total, d, generator=g), torch.randn(*lead, hkv, t_total, d, generator=g)
    tq = kivi_split(t_total, grp, min_residual=lq)  # remainder + the queries' own K/V stay full precision
    kp = kivi_quantize_keys(k[..., :tq, :], bits, grp)
    vp = kivi_quantize_values(v[..., :tq, :], bits, grp)
    kt, vt = k[..., tq:, :], v[..., tq:, :]
    q = torch.randn(*lead, hq, lq, d, generator=g)
    out = kivi_decode_attention(q, *kp, *vp, bits=bits, k_group=grp, v_group=grp, k_tail=kt, v_tail=vt)
    assert out.shape == q.shape and out.dtype == q.dtype
    kd = kivi_dequantize_keys(*kp, bits, grp)
    vd = kivi_dequantize_values(*vp, bits, grp)
    torch.testing.assert_close(out.double(), oracle(q, kd, vd, kt, vt), atol=2e-5, rtol=2e-5)
    # and quantization changes the answer only a little w.r.t. full precision (more at 2 bits)
    full = oracle(q, k[..., :tq, :], v[..., :tq, :], kt, vt)
    assert (out.double() - full).abs().max() < (0.25 if bits == 4 else 1.0)


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_kivi_decode_attention_half_dtypes(dtype, tol):
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(3, 128, 64, generator=g), torch.randn(3, 128, 64, generator=g)
    kp, vp = kivi_quantize_keys(k, 4, 32), kivi_quantize_values(v, 4, 32)
    q = torch.randn(9, 1, 64, generator=g).to(dtype)
    out = kivi_decode_attention(q, *kp, *vp, bits=4, k_group=32, v_group=32)  # no tail
    assert out.dtype == dtype
    want = oracle(
        q.float(),
        kivi_dequantize_keys(*kp, 4, 32),
        kivi_dequantize_values(*vp, 4, 32),
        torch.zeros(3, 0, 64),
        torch.zeros(3, 0, 64),
    )
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


def test_kivi_mixed_bits_and_errors():
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 64, 16, generator=g), torch.randn(2, 64, 16, generator=g)
    kp, vp = kivi_quantize_keys(k, 4, 32), kivi_quantize_values(v, 2, 16)
    q = torch.randn(2, 1, 16, generator=g)
    out = kivi_decode_attention(q, *kp, *vp, bits=4, v_bits=2, k_group=32, v_group=16)
    ref = kivi_decode_attention_ref(q, *kp, *vp, bits=4, v_bits=2, k_group=32, v_group=16)
    assert torch.equal(out, ref)
    with pytest.raises(ValueError, match="head dim"):
        kivi_decode_attention(q, *kp, *vp, bits=2, k_group=32, v_group=16)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        kivi_decode_attention(torch.randn(3, 1, 16), *kp, *vp, bits=4, v_bits=2, k_group=32, v_group=16)
