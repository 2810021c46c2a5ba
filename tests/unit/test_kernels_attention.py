"""verify_attention / gathered_attention / attention_ref against float64 SDPA with explicit masks."""

import pytest
import torch
import torch.nn.functional as F

from vericache_kernels import attention_ref, gathered_attention, gathered_attention_ref, verify_attention
from vericache_kernels._dispatch import use_triton

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


from attention_oracle import oracle  # noqa: E402


def _rand(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype)


@pytest.mark.parametrize("t,lq", [(63, 1), (500, 5), (4097, 4), (5, 5)])
@pytest.mark.parametrize("hq,hkv", [(9, 3), (4, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_verify_matches_oracle(t, lq, hq, hkv, dtype):
    g = torch.Generator().manual_seed(t * lq + hq)
    q, k, v = (
        _rand(g, 2, hq, lq, 64, dtype=dtype),
        _rand(g, 2, hkv, t, 64, dtype=dtype),
        _rand(g, 2, hkv, t, 64, dtype=dtype),
    )
    out = verify_attention(q, k, v)
    assert out.shape == q.shape and out.dtype == dtype
    empty = k[..., :0, :]
    want = oracle(q.float(), empty.float(), empty.float(), k.float(), v.float())
    torch.testing.assert_close(out.double(), want, atol=TOL[dtype], rtol=TOL[dtype])


def test_verify_square_is_standard_causal():
    g = torch.Generator().manual_seed(3)
    q, k, v = _rand(g, 4, 7, 32), _rand(g, 4, 7, 32), _rand(g, 4, 7, 32)
    torch.testing.assert_close(
        verify_attention(q, k, v), F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-5, rtol=1e-5
    )


def test_sm_scale_and_unbatched_equal_batched():
    g = torch.Generator().manual_seed(4)
    q, k, v = _rand(g, 6, 3, 16), _rand(g, 2, 40, 16), _rand(g, 2, 40, 16)
    a = verify_attention(q, k, v, sm_scale=0.3)
    b = verify_attention(q[None], k[None], v[None], sm_scale=0.3)[0]
    assert torch.equal(a, b)
    want = oracle(q * (0.3 * 16**0.5), k[:, :0], v[:, :0], k, v)  # SDPA scales by 1/sqrt(16)
    torch.testing.assert_close(a.double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("t,keep,lt,lq", [(63, 16, 1, 1), (500, 125, 8, 3), (4097, 1024, 0, 1)])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_gathered_matches_oracle(t, keep, lt, lq, idx_dtype):
    g = torch.Generator().manual_seed(t + keep)
    b, hq, hkv, d = 2, 9, 3, 64
    q, kf, vf = _rand(g, b, hq, lq, d), _rand(g, b, hkv, t, d), _rand(g, b, hkv, t, d)
    kt, vt = _rand(g, b, hkv, lt, d), _rand(g, b, hkv, lt, d)
    idx = torch.stack([torch.randperm(t, generator=g)[:keep] for _ in range(b * hkv)]).reshape(b, hkv, keep)
    out = gathered_attention(q, kf, vf, idx.to(idx_dtype), kt, vt)
    kk = torch.stack([torch.stack([kf[i, h, idx[i, h]] for h in range(hkv)]) for i in range(b)])
    vv = torch.stack([torch.stack([vf[i, h, idx[i, h]] for h in range(hkv)]) for i in range(b)])
    torch.testing.assert_close(out.double(), oracle(q, kk, vv, kt, vt), atol=2e-5, rtol=2e-5)
    assert torch.equal(out, gathered_attention_ref(q, kf, vf, idx, kt, vt))


def test_prefix_is_fully_visible_even_with_short_tail():
    """Lq > Lt: early queries see no tail token but still the whole prefix."""
    g = torch.Generator().manual_seed(5)
    q, k, v = _rand(g, 2, 4, 8), _rand(g, 2, 10, 8), _rand(g, 2, 10, 8)
    kt, vt = _rand(g, 2, 2, 8), _rand(g, 2, 2, 8)
    out = attention_ref(q, k, v, kt, vt)
    torch.testing.assert_close(out.double(), oracle(q, k, v, kt, vt), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(
        out[:, 0].double(), oracle(q[:, :1], k, v, kt[:, :0], vt[:, :0])[:, 0], atol=2e-5, rtol=2e-5
    )


def test_errors():
    q, k = torch.zeros(6, 2, 16), torch.zeros(4, 8, 16)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        verify_attention(q, k, k)
    with pytest.raises(ValueError, match="D=16"):
        verify_attention(q, torch.zeros(2, 8, 32), torch.zeros(2, 8, 32))
    with pytest.raises(ValueError, match="see no key"):
        verify_attention(torch.zeros(2, 5, 16), torch.zeros(2, 3, 16), torch.zeros(2, 3, 16))
    with pytest.raises(ValueError, match=r"q must be"):
        verify_attention(torch.zeros(16), k, k)
    with pytest.raises(ValueError, match="int32/int64"):
        gathered_attention(torch.zeros(2, 1, 16), torch.zeros(2, 8, 16), torch.zeros(2, 8, 16), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="kept_idx"):
        gathered_attention(
            torch.zeros(2, 1, 16), torch.zeros(2, 8, 16), torch.zeros(2, 8, 16), torch.zeros(3, 3, dtype=torch.long)
        )
    with pytest.raises(ValueError, match="backend"):
        verify_attention(torch.zeros(2, 1, 16), torch.zeros(2, 8, 16), torch.zeros(2, 8, 16), backend="gpu")


def test_cpu_dispatch_uses_reference(monkeypatch):
    x = torch.zeros(1)
    assert use_triton("auto", x) is False
    assert use_triton("ref", x) is False
    monkeypatch.setenv("VERICACHE_KERNELS", "ref")
    assert use_triton("auto", x) is False


@pytest.mark.parametrize("block", [7, 64, 1000])
@pytest.mark.parametrize("lq,lt", [(1, 0), (3, 5)])
def test_streamed_equals_attention_ref(block, lq, lt):
    from vericache_kernels.attention import attention_ref_streamed

    g = torch.Generator().manual_seed(block + lq)
    q, k, v = _rand(g, 2, 6, lq, 32), _rand(g, 2, 2, 300, 32), _rand(g, 2, 2, 300, 32)
    kt, vt = _rand(g, 2, 2, lt, 32), _rand(g, 2, 2, lt, 32)
    calls = []

    def load_k(s, e):
        calls.append((s, e))
        return k[:, :, s:e]

    out = attention_ref_streamed(
        q, 2, 300, load_k, lambda s, e: v[:, :, s:e], block, kt if lt else None, vt if lt else None
    )
    assert max(e - s for s, e in calls) <= block and calls[-1][1] == 300
    torch.testing.assert_close(out.double(), oracle(q, k, v, kt, vt), atol=2e-5, rtol=2e-5)
