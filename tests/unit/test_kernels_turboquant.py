"""TurboQuant-style codes: codebook, rotation, round trip and decode attention (CPU reference)."""

import math

import pytest
import torch
import torch.nn.functional as F

from vericache_kernels import (
    lloyd_max_gaussian,
    turbo_codebook,
    turbo_decode_attention,
    turbo_dequantize,
    turbo_dequantize_rotated,
    turbo_quantize,
    turbo_rotation,
    unpack_bits,
)

# Max (1960) / Lloyd optimal MSE for N(0, 1) at 1..4 bits
MAX_MSE = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497}


def _gauss_mse(c: torch.Tensor) -> float:
    """Distortion of nearest-centroid quantization of N(0,1), by numerical integration."""
    x = torch.linspace(-9, 9, 400001, dtype=torch.float64)
    cc = c.double()
    q = cc[torch.bucketize(x, (cc[:-1] + cc[1:]) / 2)]
    pdf = torch.exp(-x * x / 2) / math.sqrt(2 * math.pi)
    return float(torch.trapezoid((x - q) ** 2 * pdf, x))


def test_codebook_known_values():
    assert lloyd_max_gaussian(1) == pytest.approx((-math.sqrt(2 / math.pi), math.sqrt(2 / math.pi)), abs=1e-6)
    assert lloyd_max_gaussian(2) == pytest.approx((-1.5104, -0.4528, 0.4528, 1.5104), abs=1e-4)
    assert lloyd_max_gaussian(3)[4:] == pytest.approx((0.2451, 0.7560, 1.3439, 2.1520), abs=1e-4)


@pytest.mark.parametrize("bits", range(1, 9))
def test_codebook_sorted_symmetric_optimal(bits):
    c = torch.tensor(lloyd_max_gaussian(bits), dtype=torch.float64)
    assert c.numel() == 2**bits and (c.diff() > 0).all()
    torch.testing.assert_close(c, -c.flip(0), atol=1e-9, rtol=0)
    if bits in MAX_MSE:
        assert _gauss_mse(c) == pytest.approx(MAX_MSE[bits], rel=2e-3)
    # a perturbed codebook is worse (optimality, local check)
    assert _gauss_mse(c * 1.05) > _gauss_mse(c)
    torch.testing.assert_close(turbo_codebook(bits, 64).double(), c / 8, atol=1e-7, rtol=0)


def test_rotation_orthogonal_and_seeded():
    r = turbo_rotation(64, seed=1)
    torch.testing.assert_close(r @ r.T, torch.eye(64), atol=1e-5, rtol=0)
    assert torch.equal(r, turbo_rotation(64, seed=1))
    assert not torch.allclose(r, turbo_rotation(64, seed=2))


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_roundtrip_mse_matches_lloyd_max(bits):
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(4000, 128, generator=g) * 3
    packed, norms = turbo_quantize(x, bits, seed=5)
    assert packed.shape == (4000, 128 * bits // 8) and norms.dtype == torch.float16 and norms.shape == (4000,)
    back = turbo_dequantize(packed, norms, bits, seed=5)
    rel = ((back - x) ** 2).sum(-1) / (x**2).sum(-1)
    assert rel.mean().item() == pytest.approx(MAX_MSE[bits], rel=0.1)
    wrong = turbo_dequantize(packed, norms, bits, seed=6)  # the seed is part of the format
    assert ((wrong - x) ** 2).sum(-1).mean() > 1.5 * ((back - x) ** 2).sum(-1).mean()


def test_codes_are_nearest_centroids_and_rotated_domain():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 50, 32, generator=g)
    packed, norms = turbo_quantize(x, 3, seed=0)
    r = turbo_rotation(32, 0)
    y = (x / norms.float().unsqueeze(-1)) @ r.T
    cb = turbo_codebook(3, 32)
    want = (y.unsqueeze(-1) - cb).abs().argmin(-1)
    assert torch.equal(unpack_bits(packed, 3, 32).long(), want)
    torch.testing.assert_close(turbo_dequantize_rotated(packed, norms, 3) @ r, turbo_dequantize(packed, norms, 3))


def test_zero_vector_and_errors():
    packed, norms = turbo_quantize(torch.zeros(2, 16), 2)
    assert torch.equal(turbo_dequantize(packed, norms, 2), torch.zeros(2, 16))
    with pytest.raises(ValueError, match="bits"):
        turbo_quantize(torch.zeros(2, 16), 0)
    with pytest.raises(ValueError, match="pack into bytes"):
        turbo_quantize(torch.zeros(2, 12), 3)
    with pytest.raises(ValueError, match="norms"):
        turbo_dequantize(packed, norms[:1], 2)


@pytest.mark.parametrize("t,lq,lt,v_seed", [(63, 1, 0, None), (500, 3, 7, None), (500, 3, 7, 10)])
def test_turbo_decode_attention(t, lq, lt, v_seed, monkeypatch):
    """v_seed: values coded with their own rotation (the compressor uses seed + 1 for values)."""
    import vericache_kernels.turboquant as turbo_mod

    monkeypatch.setattr(turbo_mod, "block_tokens", lambda *a: 50)  # several blocks
    g = torch.Generator().manual_seed(t)
    hq, hkv, d, bits = 6, 2, 64, 4
    vs = 9 if v_seed is None else v_seed
    k, v = torch.randn(hkv, t, d, generator=g), torch.randn(hkv, t, d, generator=g)
    kp, vp = turbo_quantize(k, bits, seed=9), turbo_quantize(v, bits, seed=vs)
    kt, vt = torch.randn(hkv, lt, d, generator=g), torch.randn(hkv, lt, d, generator=g)
    q = torch.randn(hq, lq, d, generator=g)
    out = turbo_decode_attention(q, *kp, *vp, bits=bits, seed=9, v_seed=v_seed, k_tail=kt, v_tail=vt)
    kd, vd = turbo_dequantize(*kp, bits, seed=9), turbo_dequantize(*vp, bits, seed=vs)
    kk = torch.cat([kd, kt], 1).double().repeat_interleave(3, 0)
    vv = torch.cat([vd, vt], 1).double().repeat_interleave(3, 0)
    mask = torch.ones(lq, t + lt, dtype=torch.bool)
    for i in range(lq):
        mask[i, t:] = torch.arange(lt) <= lt - lq + i
    want = F.scaled_dot_product_attention(q.double(), kk, vv, attn_mask=mask)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
