"""Triton kernels: on CUDA, direct comparisons with the references; without CUDA, the same kernels
under the Triton interpreter (TRITON_INTERPRET=1, in a subprocess so the mode cannot leak) and an
ahead-of-time sm_90 compile, both through benchmarks/gpu_kernels_check.py."""

import json
import os
import subprocess
import sys

import pytest
import torch

import vericache_kernels as K
from vericache_kernels._dispatch import triton_available

from paths import ROOT  # noqa: E402

CHECK = ROOT / "benchmarks" / "gpu_kernels_check.py"
needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_import_has_no_side_effects():
    code = "import sys, kernels; assert 'triton' not in sys.modules, 'kernels imported triton'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def _run_check(*flags) -> dict:
    env = dict(os.environ, TRITON_DEFAULT_FP_FUSION="1")
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run(
        [sys.executable, str(CHECK), *flags, "--json"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert p.returncode in (0, 1), p.stderr[-3000:]
    return json.loads(p.stdout)


@pytest.fixture(scope="module")
def interpreted():
    return _run_check("--interpret")


FAMILIES = ["pack", "unpack", "verify", "gathered", "kivi2", "kivi4", "turbo2", "turbo4"]


@needs_triton
@pytest.mark.parametrize("family", FAMILIES)
def test_interpreted_kernels_match_reference(interpreted, family):
    rows = [r for r in interpreted["rows"] if r["case"].split()[0] == family]
    assert rows, f"no {family} case ran"
    bad = [(r["case"], r.get("error", r.get("max_err"))) for r in rows if not r["ok"]]
    assert not bad, bad


@needs_triton
def test_aot_compile_sm90():
    doc = _run_check("--compile-only", "--quick")
    assert doc["n_cases"] >= 10
    assert doc["n_failed"] == 0, [(r["case"], r.get("error")) for r in doc["rows"] if not r["ok"]]


# ---- CUDA: the compiled kernels themselves ------------------------------------------------------

TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}


def _close(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("bits", range(1, 9))
def test_cuda_pack_unpack_exact(bits):
    n = K.pad_multiple(bits) * 17
    codes = torch.randint(0, 2**bits, (63, 3, n), dtype=torch.uint8, device="cuda")
    packed = K.pack_bits(codes, bits, backend="triton")
    assert torch.equal(packed, K.pack_bits_ref(codes, bits))
    assert torch.equal(K.unpack_bits(packed, bits, n, backend="triton"), codes)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("t,lq", [(63, 1), (500, 5), (4097, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
def test_cuda_attention_ops(t, lq, dtype, d):
    torch.manual_seed(t + d)
    dev = "cuda"
    b, hq, hkv, lt = 2, 9, 3, lq + 4
    q = torch.randn(b, hq, lq, d, device=dev, dtype=dtype)
    k, v = torch.randn(b, hkv, t, d, device=dev), torch.randn(b, hkv, t, d, device=dev)
    kt, vt = torch.randn(b, hkv, lt, d, device=dev, dtype=dtype), torch.randn(b, hkv, lt, d, device=dev, dtype=dtype)
    kd, vd = k.to(dtype), v.to(dtype)
    _close(K.verify_attention(q, kd, vd, backend="triton"), K.verify_attention(q, kd, vd, backend="ref"), dtype)
    idx = torch.argsort(torch.rand(b, hkv, t, device=dev), -1)[..., : max(1, t // 4)].int()
    _close(
        K.gathered_attention(q, kd, vd, idx, kt, vt, backend="triton"),
        K.gathered_attention(q, kd, vd, idx, kt, vt, backend="ref"),
        dtype,
    )
    tq = K.kivi_split(t, 32)
    for bits, vbits in ((2, 2), (4, 4), (4, 2), (8, 8)):
        kp = K.kivi_quantize_keys(k[:, :, :tq], bits, 32)
        vp = K.kivi_quantize_values(v[:, :, :tq], vbits, 32)
        kw = dict(bits=bits, v_bits=vbits, k_group=32, v_group=32, k_tail=kt, v_tail=vt)
        _close(
            K.kivi_decode_attention(q, *kp, *vp, backend="triton", **kw),
            K.kivi_decode_attention(q, *kp, *vp, backend="ref", **kw),
            dtype,
        )
        tk, tv = K.turbo_quantize(k, bits, seed=1), K.turbo_quantize(v, vbits, seed=2)
        kw = dict(bits=bits, v_bits=vbits, seed=1, v_seed=2, k_tail=kt, v_tail=vt)
        _close(
            K.turbo_decode_attention(q, *tk, *tv, backend="triton", **kw),
            K.turbo_decode_attention(q, *tk, *tv, backend="ref", **kw),
            dtype,
        )


@needs_cuda
@pytest.mark.gpu
def test_cuda_auto_dispatch_and_unbatched():
    q = torch.randn(9, 1, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(3, 300, 64, device="cuda", dtype=torch.float16)
    out = K.verify_attention(q, k, k)  # auto -> Triton on CUDA
    _close(out, K.verify_attention(q, k, k, backend="ref"), torch.float16)
