"""VeriCache greedy output == plain full-KV greedy output, token for token, for every compressor, on
the five bundled real prompts (1.9k-5.6k tokens), 64 new tokens, batched and single-request."""
from __future__ import annotations

import dataclasses

import pytest

from vericache_connector.compressors import PRESETS, get_compressor

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_identical_to_full_kv_greedy(engine, prefills, reference, greedy_cfg, preset):
    comp = get_compressor(preset)
    compressed = [comp.compress(p.prefix) for p in prefills]
    outs, stats = engine.generate(prefills, compressed, greedy_cfg)
    for i, (out, ref) in enumerate(zip(outs, reference)):
        assert len(out) == greedy_cfg.max_new_tokens
        assert out == ref, f"{preset}: prompt {i} differs from full-KV greedy at token " \
                           f"{next(j for j, (a, b) in enumerate(zip(out, ref)) if a != b)}"
    assert stats.mean_accepted() > 0.5, f"{preset}: drafts are almost never accepted"


@pytest.mark.parametrize("preset,k,adaptive", [("snapkv-4x", 32, False), ("kivi4", 4, True),
                                               ("streamingllm-8x", 16, True)])
def test_identical_other_horizons(engine, prefills, reference, greedy_cfg, preset, k, adaptive):
    cfg = dataclasses.replace(greedy_cfg, draft_k=k, adaptive=adaptive, k_min=2, k_max=32)
    comp = get_compressor(preset)
    outs, stats = engine.generate(prefills, [comp.compress(p.prefix) for p in prefills], cfg)
    assert outs == reference
    if adaptive:
        assert len(set(stats.draft_lengths)) > 1, "adaptive draft length never changed"


def test_single_request_matches_batched(engine, prefills, reference, greedy_cfg):
    comp = get_compressor("tova-4x")
    outs, _ = engine.generate([prefills[2]], [comp.compress(prefills[2].prefix)], greedy_cfg)
    assert outs[0] == reference[2]


def test_lossy_decoding_drifts(engine, prefills, reference, greedy_cfg):
    """The premise: decoding on the compressed KV alone drifts from the full-KV output somewhere."""
    comp = get_compressor("streamingllm-8x")
    lossy = engine.generate_lossy(prefills, [comp.compress(p.prefix) for p in prefills], greedy_cfg)
    assert any(a != b for a, b in zip(lossy, reference))
