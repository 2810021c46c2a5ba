"""KVQuant-style and RotateKV-style quantizers (kernels/kvquant.py, kernels/rotatekv.py,
compressors/kvquant.py, compressors/rotatekv.py) against their reference maths on random inputs."""

import math

import pytest
import torch

from vericache_connector.compressors import LayeredKV, PrefixKV, get_compressor
from vericache_connector.engine import DecodeConfig
from vericache_connector.model.causal_lm import apply_rope
from vericache_kernels.bitpack import unpack_bits_ref
from vericache_kernels.kivi import kivi_dequantize_values, kivi_quantize_values
from vericache_kernels.kvquant import (
    kvquant_dequantize_keys,
    kvquant_dequantize_values,
    kvquant_quantize_keys,
    kvquant_quantize_values,
    rope,
    unrope,
)
from vericache_kernels.rotatekv import hadamard_rotation, rotatekv_dequantize, rotatekv_quantize

from tiny_model import tiny_engine

D = 64
INV = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))


def pre_rope_keys(h=3, t=97, seed=0):
    """Pre-RoPE keys with a few large channels (the outliers KVQuant targets) and rare spikes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(h, t, D, generator=g)
    x[..., 3] = x[..., 3] * 8 + 20
    x[..., 40] *= 12
    x[0, 5, 7] = 60.0  # a single spike
    return x


def test_rope_matches_the_model_and_inverts():
    x = torch.randn(2, 13, D)
    pos = torch.arange(7, 20).float()
    emb = torch.cat([pos[:, None] * INV, pos[:, None] * INV], -1)
    want = apply_rope(x[None], emb.cos()[None, None], emb.sin()[None, None])[0]
    torch.testing.assert_close(rope(x, INV, 7), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(unrope(rope(x, INV, 7), INV, 7), x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("m", [0, 2])
def test_kvquant_keys_dense_and_sparse(bits, m):
    pre = pre_rope_keys()
    k = rope(pre, INV, 5)
    q = kvquant_quantize_keys(k, INV, bits, m, pos0=5)
    h, t, _ = k.shape
    assert q["packed"].shape == (h, t, D * bits // 8) and q["scale"].shape == (h, 1, D)
    assert q["out_pos"].shape == (h, 2 * m, D) and q["out_val"].dtype == torch.float16
    pre32 = unrope(k.float(), INV, 5)
    # the outliers are exactly the m smallest and m largest pre-RoPE values of each channel
    order = pre32.argsort(-2)
    want = torch.cat([order[:, :m], order[:, t - m :]], 1).sort(1).values
    assert torch.equal(q["out_pos"].long().sort(1).values, want)
    # dense part: codes * scale + mn within scale / 2 of the clamped value; outliers within fp16 of delta
    codes = unpack_bits_ref(q["packed"], bits, D).float()
    dense = codes * q["scale"].float() + q["mn"].float()
    is_out = torch.zeros_like(pre32, dtype=torch.bool).scatter_(1, q["out_pos"].long(), True)
    err = (dense - pre32).abs()
    assert bool((err[~is_out] <= q["scale"].float().expand_as(err)[~is_out] / 2 + 1e-5).all())
    pre_hat = dense.scatter_add(1, q["out_pos"].long(), q["out_val"].float())
    out_err = (pre_hat - pre32).abs()[is_out]
    assert bool((out_err <= pre32.abs()[is_out] * 2e-3 + 1e-3).all())
    # decoded keys = RoPE(dense + sparse) at the same positions: errors are the pre-RoPE errors rotated
    k_hat = kvquant_dequantize_keys(q, INV, bits, pos0=5, backend="ref")
    torch.testing.assert_close(k_hat, rope(pre_hat, INV, 5), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close((k_hat - k).norm(dim=-1), (pre_hat - pre32).norm(dim=-1), rtol=1e-3, atol=1e-4)


def test_kvquant_outliers_buy_precision_where_kivi_range_is_wide():
    """With the spike sparse, its channel's range shrinks, and the other entries' error with it."""
    pre = pre_rope_keys()
    k = rope(pre, INV)
    errs = {}
    for m in (0, 2):
        q = kvquant_quantize_keys(k, INV, 4, m)
        errs[m] = (kvquant_dequantize_keys(q, INV, 4, backend="ref") - k).pow(2).mean().item()
    assert errs[2] < 0.7 * errs[0], errs


@pytest.mark.parametrize("bits", [2, 4])
def test_kvquant_values_per_token(bits):
    v = pre_rope_keys(seed=1)
    q = kvquant_quantize_values(v, bits, 1)
    assert q["scale"].shape == (3, 97, 1) and q["out_pos"].shape == (3, 97, 2)
    order = v.argsort(-1)
    assert torch.equal(
        q["out_pos"].long().sort(-1).values, torch.cat([order[..., :1], order[..., -1:]], -1).sort(-1).values
    )
    v_hat = kvquant_dequantize_values(q, bits, backend="ref")
    codes = unpack_bits_ref(q["packed"], bits, D).float()
    dense = codes * q["scale"].float() + q["mn"].float()
    want = dense.scatter_add(-1, q["out_pos"].long(), q["out_val"].float())
    torch.testing.assert_close(v_hat, want)


def test_hadamard_rotation_is_orthogonal_with_seeded_signs():
    r = hadamard_rotation(D, 3)
    torch.testing.assert_close(r @ r.T, torch.eye(D), atol=1e-6, rtol=0)
    assert torch.allclose(r.abs(), torch.full_like(r, 1 / math.sqrt(D)))
    assert not torch.equal(r, hadamard_rotation(D, 4))
    with pytest.raises(ValueError, match="48"):
        hadamard_rotation(48)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_rotatekv_is_kivi_value_format_in_the_rotated_basis(bits):
    x = rope(pre_rope_keys(seed=2), INV)
    packed, scale, mn = rotatekv_quantize(x, bits, 16, seed=7)
    r = hadamard_rotation(D, 7)
    p2, s2, m2 = kivi_quantize_values(x @ r.T, bits, 16)
    assert torch.equal(packed, p2) and torch.equal(scale, s2) and torch.equal(mn, m2)
    x_hat = rotatekv_dequantize(packed, scale, mn, bits, 16, seed=7, backend="ref")
    torch.testing.assert_close(x_hat, kivi_dequantize_values(packed, scale, mn, bits, 16) @ r, rtol=1e-6, atol=1e-5)
    # per token: the rotation keeps the error norm; each rotated entry is within scale / 2
    bound = (scale.float().pow(2).sum(-1) * 16 / 4).sqrt()
    assert bool(((x_hat - x).norm(dim=-1) <= bound * 1.0001 + 1e-4).all())


def test_rotation_beats_per_token_quantization_of_raw_keys():
    """Keys with outlier channels: 2-bit per token is far better after the Hadamard rotation."""
    x = rope(pre_rope_keys(seed=3), INV)
    p, s, m = rotatekv_quantize(x, 2, 32)
    rot = (rotatekv_dequantize(p, s, m, 2, 32, backend="ref") - x).pow(2).mean()
    p, s, m = kivi_quantize_values(x, 2, 32)
    raw = (kivi_dequantize_values(p, s, m, 2, 32) - x).pow(2).mean()
    assert rot < 0.5 * raw, (rot, raw)


def prefix(t=70, layers=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = [rope(pre_rope_keys(2, t, seed + i), INV) for i in range(layers)]
    values = [torch.randn(2, t, D, generator=g) for _ in range(layers)]
    return PrefixKV(keys, values, inv_freq=INV)


def test_kvquant_compressor_layout_bytes_validate_payload():
    c = get_compressor("kvquant:bits=2,outliers=0.06,sink=2")
    p = prefix()
    out = c.compress(p)
    s, mk, mv = c.split(70, D)
    assert (s, mk, mv) == (2, 2, 1)
    assert {n: (t.dtype, tuple(t.shape)) for n, t in out.layers[0].items()} == c.layout(70, 2, D)
    assert out.nbytes == sum(t.nbytes for layer in out.layers for t in layer.values())
    c.validate(out, 70, 2, 2, D)
    back = LayeredKV.from_payload(*out.to_payload())
    k, v = back.layer_kv(1, torch.float32)
    assert torch.equal(k[:, :2], p.keys[1][:, :2].half().float())  # the sink, float16
    for got, want in ((k, p.keys[1]), (v, p.values[1])):  # 2 bits: a coarse but faithful copy
        assert 0 < (got - want).norm() / want.norm() < 0.5
    bad = LayeredKV(out.spec, {**out.meta, "inv_freq": out.meta["inv_freq"][:-1]}, out.layers)
    with pytest.raises(ValueError, match="inv_freq"):
        c.validate(bad, 70, 2, 2, D)
    with pytest.raises(ValueError, match="k_out_pos"):
        layers = [dict(layer) for layer in out.layers]
        layers[0]["k_out_pos"] = layers[0]["k_out_pos"] + 1000
        c.validate(LayeredKV(out.spec, out.meta, layers), 70, 2, 2, D)
    with pytest.raises(ValueError, match="inv_freq"):
        c.compress(PrefixKV(p.keys, p.values))
    with pytest.raises(ValueError, match="0.7"):
        get_compressor("kvquant:outliers=0.7")


def test_rotatekv_compressor_bytes_and_generic_validate():
    c = get_compressor("rotatekv2")
    p = prefix()
    out = c.compress(p)
    layer = out.layers[0]
    assert layer["k"].shape == (2, 66, D // 4) and layer["k_scale"].shape == (2, 66, 2)  # 2 bits: 4 codes a byte
    assert out.nbytes == sum(t.nbytes for layer in out.layers for t in layer.values())
    assert out.nbytes < 0.2 * p.nbytes
    c.validate(out, 70, 2, 2, D)  # Compressor.validate: the reference layout of a zero prefix
    with pytest.raises(ValueError, match="group"):
        get_compressor("rotatekv:group=48").compress(p)


@pytest.mark.parametrize("spec", ["kvquant4", "kvquant2", "rotatekv4", "rotatekv2"])
def test_vericache_exact_on_tiny_model(spec):
    eng = tiny_engine(seed=2)
    g = torch.Generator().manual_seed(9)
    pre = [eng.prefill(torch.randint(0, 256, (t,), generator=g).tolist()) for t in (80, 53)]
    cfg = DecodeConfig(max_new_tokens=24, draft_k=6, stop_at_eos=False)
    comp = get_compressor(spec)
    outs, stats = eng.generate(pre, [comp.compress(p.prefix) for p in pre], cfg)
    assert outs == eng.generate_full(pre, cfg)
    assert any(stats.accepted)
