"""Prefix + tail attention pieces (kernels/prefix_attention.py) against float64 SDPA with explicit masks:
the fused CPU path (auto) and the float32 references, on odd sizes, in float32/float16/bfloat16."""

import math

import pytest
import torch

import vericache_kernels as K

from attention_oracle import oracle

TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
SIZES = [(63, 1, 4), (500, 3, 7), (4097, 4, 4)]  # (prefix T, queries Lq, tail Lt)


def _rand(g, *shape):
    return torch.randn(*shape, generator=g)


def _lse64(q, k, scale=None):
    """float64 log-sum-exp of every query over all of k (GQA by repeating heads)."""
    rep = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(rep, 1)
    s = q.double() @ kk.transpose(-1, -2) * (scale or 1 / math.sqrt(q.shape[-1]))
    return torch.logsumexp(s, -1)


@pytest.mark.parametrize("t,lq,lt", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", ["auto", "ref"])
def test_prefix_lse_matches_oracle(t, lq, lt, dtype, backend):
    g = torch.Generator().manual_seed(t + lq)
    q, k, v = _rand(g, 2, 9, lq, 64), _rand(g, 2, 3, t, 64).to(dtype), _rand(g, 2, 3, t, 64).to(dtype)
    out, lse = K.prefix_attention_lse(q, k, v, backend=backend)
    assert out.dtype == lse.dtype == torch.float32 and lse.shape == (2, 9, lq)
    empty = k[..., :0, :].float()
    qq = q.to(dtype).float() if backend == "auto" else q  # the fused path reads q in K's dtype
    tol = TOL[dtype] if backend == "auto" else 2e-5
    torch.testing.assert_close(out.double(), oracle(qq, k.float(), v.float(), empty, empty), atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), _lse64(qq, k), atol=tol * 10, rtol=tol)


def test_prefix_lse_empty_prefix():
    q = torch.randn(1, 9, 2, 64)
    out, lse = K.prefix_attention_lse(q, torch.zeros(1, 3, 0, 64), torch.zeros(1, 3, 0, 64))
    assert torch.equal(out, torch.zeros_like(out)) and torch.isinf(lse).all() and (lse < 0).all()


@pytest.mark.parametrize("lq", [1, 3])
def test_tail_lse_per_row_lengths(lq):
    g = torch.Generator().manual_seed(lq)
    q, k, v = _rand(g, 3, 6, lq, 32), _rand(g, 3, 2, 40, 32), _rand(g, 3, 2, 40, 32)
    k[1, :, 20:] = 1e4  # past row 1's length: must not be read
    lengths = torch.tensor([40, 20, 5])
    out, lse = K.tail_attention_lse(q, k, v, lengths)
    for b, n in enumerate(lengths.tolist()):
        empty = k[b, :, :0]
        want = oracle(q[b], empty, empty, k[b, :, :n], v[b, :, :n])
        torch.testing.assert_close(out[b].double(), want, atol=2e-5, rtol=2e-5)
    assert torch.isfinite(lse).all()


@pytest.mark.parametrize("t,lq,lt", SIZES)
def test_merge_of_parts_is_attention_over_both(t, lq, lt):
    g = torch.Generator().manual_seed(t)
    q, k, v = _rand(g, 2, 9, lq, 64), _rand(g, 2, 3, t, 64), _rand(g, 2, 3, t, 64)
    kt, vt = _rand(g, 2, 3, lt, 64), _rand(g, 2, 3, lt, 64)
    merged = K.merge_attention(*K.prefix_attention_lse_ref(q, k, v), *K.tail_attention_lse(q, kt, vt))
    torch.testing.assert_close(merged.double(), oracle(q, k, v, kt, vt), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("t,lq,lt", SIZES + [(0, 2, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefix_attention_dispatch(t, lq, lt, dtype):
    g = torch.Generator().manual_seed(t * 7 + lq)
    q, k, v = _rand(g, 2, 9, lq, 64), _rand(g, 2, 3, t, 64).to(dtype), _rand(g, 2, 3, t, 64).to(dtype)
    kt, vt = _rand(g, 2, 3, lt, 64), _rand(g, 2, 3, lt, 64)
    for backend, tol in (("auto", TOL[dtype]), ("ref", 2e-5)):
        out = K.prefix_attention(q, k, v, kt, vt, backend=backend)
        assert out.shape == q.shape and out.dtype == q.dtype
        want = oracle(q.to(dtype).float() if backend == "auto" else q, k.float(), v.float(), kt, vt)
        torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    unbatched = K.prefix_attention(q[0], k[0], v[0], kt[0], vt[0])
    torch.testing.assert_close(unbatched, K.prefix_attention(q, k, v, kt, vt)[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("n,lq", [(63, 1), (500, 3), (4097, 1), (4097, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cache_attention_rows_of_different_lengths(n, lq, dtype):
    g = torch.Generator().manual_seed(n + lq)
    cap = n + 9  # a view into a larger buffer, as a cache has
    k, v = _rand(g, 3, 3, cap, 64).to(dtype), _rand(g, 3, 3, cap, 64).to(dtype)
    q = _rand(g, 3, 9, lq, 64)
    lengths = torch.tensor([n, n - 17, lq + 2])
    kv, vv = k[:, :, :n], v[:, :, :n]
    for backend, tol in (("auto", TOL[dtype]), ("ref", 2e-5)):
        out = K.cache_attention(q, kv, vv, lengths, backend=backend)
        assert out.shape == q.shape and out.dtype == q.dtype
        for b, m in enumerate(lengths.tolist()):
            empty = kv[b, :, :0].float()
            qb = q[b].to(dtype).float() if backend == "auto" else q[b]
            want = oracle(qb, empty, empty, kv[b, :, :m].float(), vv[b, :, :m].float())
            torch.testing.assert_close(out[b].double(), want, atol=tol, rtol=tol)
    same = K.cache_attention(q, kv, vv)  # default: every row holds all n entries
    torch.testing.assert_close(same, K.cache_attention(q, kv, vv, torch.full((3,), n)), atol=0, rtol=0)


def test_env_ref_forces_the_references(monkeypatch):
    g = torch.Generator().manual_seed(0)
    q, k, v = _rand(g, 1, 9, 1, 64), _rand(g, 1, 3, 300, 64).half(), _rand(g, 1, 3, 300, 64).half()
    fused = K.cache_attention(q, k, v)
    monkeypatch.setenv("VERICACHE_KERNELS", "ref")
    assert torch.equal(K.cache_attention(q, k, v), K.cache_attention_ref(q, k, v))
    assert not torch.equal(fused, K.cache_attention_ref(q, k, v))  # auto really ran another path
    assert torch.equal(K.prefix_attention_lse(q, k, v)[0], K.prefix_attention_lse_ref(q, k, v)[0])


def test_bad_inputs_raise_value_error():
    q, k = torch.randn(1, 9, 2, 64), torch.randn(1, 3, 10, 64)
    with pytest.raises(ValueError, match="lengths"):
        K.cache_attention(q, k, k, torch.tensor([1]))  # shorter than the 2 queries
    with pytest.raises(ValueError, match="lengths"):
        K.tail_attention_lse(q, k, k, torch.tensor([11]))
    with pytest.raises(ValueError, match="backend"):
        K.prefix_attention_lse(q, k, k, backend="cuda")
    with pytest.raises(ValueError, match="KV heads"):
        K.cache_attention(q, torch.randn(1, 4, 10, 64), torch.randn(1, 4, 10, 64))
