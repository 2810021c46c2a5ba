"""The Triton dequantization kernel of the KVQuant / RotateKV formats (kernels/_quant_triton.py)
against the torch references, under the Triton interpreter (TRITON_INTERPRET=1, in a subprocess so the
mode cannot leak into other tests); on CUDA the compiled kernel directly."""

import json
import os
import subprocess
import sys

import pytest
import torch

from vericache_kernels._dispatch import triton_available

from paths import ROOT

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed")

CHECK = r"""
import json, torch
from vericache_kernels.kvquant import kvquant_quantize_keys, kvquant_quantize_values
from vericache_kernels.kvquant import kvquant_dequantize_keys, kvquant_dequantize_values
from vericache_kernels.rotatekv import rotatekv_quantize, rotatekv_dequantize

dev = "cuda" if torch.cuda.is_available() else "cpu"
g = torch.Generator().manual_seed(0)
rows = []
for d in (32, 64):
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    for bits in (2, 3, 4, 8):
        for t in (1, 37):  # rows not a multiple of the block
            x = (torch.randn(3, t, d, generator=g) * 3).to(dev)
            x[..., 1] += 9
            q = kvquant_quantize_keys(x, inv.to(dev), bits, 1 if t > 3 else 0, pos0=11)
            a = kvquant_dequantize_keys(q, inv.to(dev), bits, pos0=11, backend="ref")
            b = kvquant_dequantize_keys(q, inv.to(dev), bits, pos0=11, backend="triton")
            rows.append({"case": f"kvquant-keys d={d} bits={bits} t={t}", "err": (a - b).abs().max().item(), "scale": a.abs().max().item()})
            q = kvquant_quantize_values(x, bits, 1)
            a = kvquant_dequantize_values(q, bits, backend="ref")
            b = kvquant_dequantize_values(q, bits, backend="triton")
            rows.append({"case": f"kvquant-values d={d} bits={bits} t={t}", "err": (a - b).abs().max().item(), "scale": a.abs().max().item()})
            for group in (16, d):
                p, s, m = rotatekv_quantize(x, bits, group, seed=3)
                a = rotatekv_dequantize(p, s, m, bits, group, seed=3, backend="ref")
                b = rotatekv_dequantize(p, s, m, bits, group, seed=3, backend="triton")
                rows.append({"case": f"rotatekv d={d} bits={bits} t={t} group={group}", "err": (a - b).abs().max().item(), "scale": a.abs().max().item()})
print(json.dumps(rows))
"""


def run_check(interpret: bool) -> list[dict]:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    p = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def check_rows(rows):
    assert len(rows) == 2 * 4 * 2 * 4
    bad = [r for r in rows if not r["err"] <= 1e-5 * max(1.0, r["scale"])]
    assert not bad, bad


@needs_triton
def test_interpreted_dequant_kernel_matches_reference():
    check_rows(run_check(interpret=True))


@needs_triton
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_dequant_kernel_matches_reference():
    check_rows(run_check(interpret=False))
