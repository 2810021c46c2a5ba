"""Attention over a packed paged prefix + a float paged tail (kernels/paged_packed.py): the fused C++ CPU kernel,
the vectorized torch path and the Triton kernel (under Triton's CPU interpreter, in a subprocess) against the
torch reference on ragged rows (empty, partial-block and multi-block prefixes, GQA, several queries causal
among themselves); the compressors' codes re-laid into blocks decode to exactly what the compressors decode;
a block costs exactly its codes and scales."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

import vericache_kernels.paged_packed as PP
from vericache_connector.compressors import PrefixKV, get_compressor
from vericache_kernels._dispatch import triton_available

from paths import ROOT

FORMATS = {
    "kivi4": PP.PackedFormat("kivi", 4, 4, 32, 16),
    "kivi2": PP.PackedFormat("kivi", 2, 2, 32, 16),
    "int8": PP.PackedFormat("int8"),
    "fp8": PP.PackedFormat("fp8"),
}
# rows: empty prefix, 1 token, a block less one, a whole block, several blocks; tails with 1-4 queries
PREFIX, TAIL, QUERIES = [0, 1, 127, 128, 300, 1000], [3, 1, 130, 128, 40, 7], [1, 1, 2, 1, 4, 3]


def close(out, ref):
    scale = max(1.0, float(ref.abs().max()))
    return float((out.float() - ref.float()).abs().max()) / scale


@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_packed_attention_matches_the_reference_on_ragged_rows(name, backend):
    from vericache_kernels import _packed_cpu

    if backend == "cpp" and not _packed_cpu.available():
        assert shutil.which("g++") is None and shutil.which("c++") is None, "a compiler is here but the build failed"
        pytest.skip("no C++ compiler: the dispatch uses the torch path")
    for tail_dtype in (torch.float16, torch.float32, torch.bfloat16):
        args = PP.random_packed_case(FORMATS[name], PREFIX, TAIL, QUERIES, 9, 3, 64, tail_dtype=tail_dtype, seed=1)
        ref = PP.packed_paged_attention_ref(*args)
        out = PP.packed_paged_attention(*args, backend=backend)
        assert close(out, ref) < 2e-5, (name, backend, tail_dtype)


def test_auto_dispatch_on_the_cpu_runs_the_fused_kernel_when_it_builds(monkeypatch):
    from vericache_kernels import _packed_cpu

    args = PP.random_packed_case(FORMATS["kivi4"], PREFIX, TAIL, QUERIES, 4, 2, 32, seed=2)
    calls = []
    orig = _packed_cpu.attention
    monkeypatch.setattr(_packed_cpu, "attention", lambda *a: calls.append(1) or orig(*a))
    ref = PP.packed_paged_attention_ref(*args)
    assert close(PP.packed_paged_attention(*args), ref) < 2e-5
    assert bool(calls) == _packed_cpu.available()
    monkeypatch.setenv("VERICACHE_KERNELS", "ref")
    calls.clear()
    assert close(PP.packed_paged_attention(*args), ref) < 2e-5 and not calls


@pytest.mark.parametrize("spec", ["kivi4", "kivi2", "int8", "fp8"])
def test_blocks_hold_the_compressors_codes_and_cost_their_bytes(spec):
    """A prompt's compressed layer re-laid into blocks decodes to what the compressor decodes, and a whole block
    costs the compressor's own bytes for its tokens (the budget counts packed bytes)."""
    torch.manual_seed(0)
    h, d, bs, n = 3, 64, 128, 2 * 128 + 160  # KIVI keeps its residual window out of the blocks
    k, v = torch.randn(h, n, d) * 3, torch.randn(h, n, d)
    comp = get_compressor(spec).compress(PrefixKV([k], [v]))
    fmt = PP.PackedFormat.from_meta(comp.meta)
    assert fmt is not None and fmt.kind == ("kivi" if spec.startswith("kivi") else spec)
    layer = {name: x for name, x in comp.layers[0].items() if not name.endswith("_tail")}
    nq = comp.meta.get("quantized_tokens", n)
    cache = PP.new_packed_cache(fmt, 6, h, d, bs)
    ids = [4, 1, 5, 0][: math.ceil(nq / bs)]
    PP.packed_write(cache, ids, PP.to_blocks(fmt, layer, nq, bs))
    table = torch.tensor([ids], dtype=torch.int32)
    gk, gv = PP.packed_gather(fmt, cache, table, 0, nq)
    dk, dv = comp.layer_kv(0, torch.float32)
    assert torch.allclose(gk, dk[:, :nq], atol=1e-6) and torch.allclose(gv, dv[:, :nq], atol=1e-6)
    per_token = sum(x.nbytes for x in layer.values()) / nq
    assert fmt.block_bytes(h, d, bs) == pytest.approx(per_token * bs)
    fp16_block = 2 * h * d * bs * 2
    assert fmt.block_bytes(h, d, bs) < fp16_block * (0.6 if spec != "kivi2" else 0.3)


def test_bad_formats_are_value_errors():
    with pytest.raises(ValueError, match="kind must be one of"):
        PP.PackedFormat("kivi3x")
    with pytest.raises(ValueError, match="k_bits must be 2, 4 or 8"):
        PP.PackedFormat("kivi", 3, 3, 32, 16)
    with pytest.raises(ValueError, match="key group 48 must divide block_size 128"):
        PP.new_packed_cache(PP.PackedFormat("kivi", 4, 4, 48, 16), 2, 2, 64, 128)
    with pytest.raises(ValueError, match="backend must be one of"):
        PP.packed_paged_attention(*PP.random_packed_case(FORMATS["int8"], [1], [1], [1]), backend="fast")
    assert PP.PackedFormat.from_meta({"compressor": "snapkv"}) is None


TRITON_CHECK = """
import json, sys, torch
sys.path.insert(0, {root!r})
import vericache_kernels.paged_packed as PP
out = {{}}
for name, fmt in {formats}.items():
    args = PP.random_packed_case(PP.PackedFormat(*fmt), {prefix}, {tail}, {queries}, 4, 2, 32, block_size=64, seed=3)
    ref = PP.packed_paged_attention_ref(*args)
    got = PP.packed_paged_attention(*args, backend="triton")
    out[name] = float((got - ref).abs().max()) / max(1.0, float(ref.abs().max()))
print(json.dumps(out))
"""


@pytest.mark.skipif(not triton_available(), reason="triton not installed")
def test_triton_kernel_matches_the_reference_under_the_interpreter():
    formats = {name: (f.kind, f.k_bits, f.v_bits, f.k_group, f.v_group) for name, f in FORMATS.items()}
    code = TRITON_CHECK.format(
        root=str(ROOT / "kernels" / ".."),
        formats=formats,
        prefix=[0, 1, 64, 200],
        tail=[3, 1, 65, 9],
        queries=[1, 1, 2, 3],
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    errs = json.loads(p.stdout.strip().splitlines()[-1])
    assert set(errs) == set(FORMATS) and all(e < 2e-5 for e in errs.values()), errs
