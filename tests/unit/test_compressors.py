"""Compressors against reference math on random inputs (no model needed)."""

from __future__ import annotations

import math

import pytest
import torch

from vericache_connector.compressors import PRESETS, LayeredKV, PrefixKV, get_compressor

H_KV, H_Q, D, LAYERS = 3, 9, 64, 2


def random_prefix(t: int, seed: int = 0, window: int = 32) -> PrefixKV:
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(H_KV, t, D, generator=g) * (1 + torch.rand(1, 1, D, generator=g) * 4) for _ in range(LAYERS)]
    values = [torch.randn(H_KV, t, D, generator=g) for _ in range(LAYERS)]
    obs = [torch.randn(H_Q, min(window, t), D, generator=g) for _ in range(LAYERS)]
    return PrefixKV(keys, values, obs)


def kept_positions(c: LayeredKV, layer: int = 0) -> list[list[int]]:
    return c.layers[layer]["idx"].tolist()


# ---- token dropping -----------------------------------------------------------------------------
@pytest.mark.parametrize("t,ratio", [(63, 4), (500, 8), (1000, 3.5)])
def test_streamingllm_keeps_sinks_and_recent(t, ratio):
    pre = random_prefix(t)
    c = get_compressor(f"streamingllm:ratio={ratio},sinks=4").compress(pre)
    keep = math.ceil(t / ratio)
    expect = list(range(4)) + list(range(t - (keep - 4), t))
    assert kept_positions(c) == [expect] * H_KV
    torch.testing.assert_close(c.layer_kv(1, torch.float32)[0], pre.keys[1][:, expect])


def snapkv_reference(obs, keys, keep, window, kernel):
    """Naive loops: per KV head, sum over its query heads and the window of causal softmax scores."""
    hq, w, d = obs.shape
    hk, t, _ = keys.shape
    g = hq // hk
    out = []
    for h in range(hk):
        score = torch.zeros(t, dtype=torch.float64)
        for qh in range(h * g, (h + 1) * g):
            for i in range(w):
                visible = t - w + i + 1
                logits = keys[h, :visible].double() @ obs[qh, i].double() / math.sqrt(d)
                score[:visible] += torch.softmax(logits, 0)
        pooled = torch.zeros(t, dtype=torch.float64)
        for j in range(t):
            lo, hi = max(0, j - kernel // 2), min(t, j + kernel // 2 + 1)
            pooled[j] = score[lo:hi].mean()
        pooled[t - w :] = float("inf")
        out.append(sorted(pooled.topk(keep).indices.tolist()))
    return out


@pytest.mark.parametrize("t,ratio", [(63, 2), (500, 4)])
def test_snapkv_matches_naive_reference(t, ratio):
    pre = random_prefix(t, seed=1)
    c = get_compressor(f"snapkv:ratio={ratio},window=16,kernel=5").compress(pre)
    keep = math.ceil(t / ratio)
    assert kept_positions(c, 1) == snapkv_reference(pre.obs_queries[1][:, -16:], pre.keys[1], keep, 16, 5)


def test_tova_keeps_top_last_query_attention():
    pre = random_prefix(300, seed=2)
    c = get_compressor("tova:ratio=4").compress(pre)
    q, k = pre.obs_queries[0][:, -1], pre.keys[0]
    for h in range(H_KV):
        probs = torch.stack([torch.softmax(k[h] @ q[qh] / 8.0, 0) for qh in range(3 * h, 3 * h + 3)]).sum(0)
        probs[-1] = float("inf")
        assert kept_positions(c)[h] == sorted(probs.topk(75).indices.tolist())


def test_knorm_keeps_lowest_norm_keys():
    pre = random_prefix(257, seed=3)
    c = get_compressor("knorm:ratio=4").compress(pre)
    for h in range(H_KV):
        norms = pre.keys[0][h].norm(dim=-1)
        assert kept_positions(c)[h] == sorted((-norms).topk(65).indices.tolist())


def test_dropping_bytes_are_kept_tensors():
    pre = random_prefix(400)
    c = get_compressor("snapkv-4x").compress(pre)
    keep = 100
    assert c.nbytes == LAYERS * (2 * H_KV * keep * D * 4 + H_KV * keep * 4)


# ---- quantization -------------------------------------------------------------------------------
def test_int8_matches_reference_math():
    pre = random_prefix(129)
    c = get_compressor("int8").compress(pre)
    x = pre.keys[0]
    scale = (x.abs().amax(-1, keepdim=True) / 127).half().float()
    expect = (x / scale).round().clamp(-127, 127) * scale
    torch.testing.assert_close(c.layer_kv(0, torch.float32)[0], expect)
    assert c.nbytes == LAYERS * 2 * (H_KV * 129 * D + H_KV * 129 * 2)


def test_fp8_error_within_e4m3_precision():
    pre = random_prefix(200)
    c = get_compressor("fp8").compress(pre)
    x = pre.values[1]
    err = (c.layer_kv(1, torch.float32)[1] - x).abs()
    scale = x.abs().amax(-1, keepdim=True) / 448
    assert bool((err <= x.abs() * 2**-4 + scale * 2**-6 + 1e-6).all())
    assert c.layers[0]["k"].dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("t", [63, 500])
def test_kivi_matches_reference_math(bits, t):
    pre = random_prefix(t, seed=bits)
    comp = get_compressor(f"kivi:bits={bits},group=32,value_group=32,residual=16")
    c = comp.compress(pre)
    n_q = (t - 16) // 32 * 32
    k, v = pre.keys[0], pre.values[0]
    got_k, got_v = c.layer_kv(0, torch.float32)
    levels = 2**bits - 1
    # keys: per channel over groups of 32 tokens
    kg = k[:, :n_q].reshape(H_KV, n_q // 32, 32, D)
    mn, mx = kg.amin(2, keepdim=True), kg.amax(2, keepdim=True)
    step = (mx - mn) / levels
    assert bool(((got_k[:, :n_q].reshape_as(kg) - kg).abs() <= step / 2 + 2e-3 * step + 1e-6).all())
    # values: per token over groups of 32 channels
    vg = v[:, :n_q].reshape(H_KV, n_q, D // 32, 32)
    vstep = (vg.amax(-1, keepdim=True) - vg.amin(-1, keepdim=True)) / levels
    assert bool(((got_v[:, :n_q].reshape_as(vg) - vg).abs() <= vstep / 2 + 2e-3 * vstep + 1e-6).all())
    # residual window: float16 copies
    torch.testing.assert_close(got_k[:, n_q:], k[:, n_q:].half().float())
    # stored bytes: packed codes + fp16 scale/min + fp16 tail
    per_layer = (
        2 * H_KV * n_q * D * bits // 8
        + 2 * 2 * H_KV * (n_q // 32) * D
        + 2 * 2 * H_KV * n_q * (D // 32)
        + 2 * 2 * H_KV * (t - n_q) * D
    )
    assert c.nbytes == LAYERS * per_layer


@pytest.mark.parametrize("kb,vb,kd,vd", [(4, 3, 0.00950, 0.03454), (3, 2, 0.03454, 0.1175)])
def test_turboquant_distortion_matches_lloyd_max(kb, vb, kd, vd):
    """After a random rotation every coordinate is ~N(0, 1/D): the relative MSE of the reconstruction
    must be the Lloyd-Max distortion of a unit Gaussian at that bit width."""
    pre = random_prefix(2000, seed=7)
    c = get_compressor(f"turboquant:key_bits={kb},value_bits={vb}").compress(pre)
    k_hat, v_hat = c.layer_kv(0, torch.float32)
    for x, x_hat, dist in ((pre.keys[0], k_hat, kd), (pre.values[0], v_hat, vd)):
        rel = ((x - x_hat).pow(2).sum(-1) / x.pow(2).sum(-1)).mean().item()
        assert dist * 0.8 < rel < dist * 1.25, (rel, dist)
    assert c.nbytes == LAYERS * (H_KV * 2000 * (D * kb // 8 + D * vb // 8 + 4))


# ---- interface ----------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_payload_round_trip_and_shapes(preset):
    pre = random_prefix(300, seed=5)
    c = get_compressor(preset).compress(pre)
    meta, layers = c.to_payload()
    back = LayeredKV.from_payload(meta, layers)
    assert back.spec == c.spec and back.nbytes == c.nbytes
    for layer in range(LAYERS):
        k, v = back.layer_kv(layer, torch.float32)
        assert k.shape == v.shape and k.shape[0] == H_KV and k.shape[2] == D
    assert c.nbytes < pre.nbytes


@pytest.mark.parametrize(
    "spec,needle",
    [
        ("nope", "'nope'"),
        ("kivi:bits=5", "5"),
        ("snapkv:ratio=0.5", "0.5"),
        ("snapkv:ratio=abc", "'abc'"),
        ("kivi:colour=red", "'colour=red'"),
        ("turboquant:key_bits=9", "9"),
        ("", "''"),
        ("streamingllm:sinks=-1", "-1"),
    ],
)
def test_bad_specs_name_the_bad_value(spec, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        get_compressor(spec)
