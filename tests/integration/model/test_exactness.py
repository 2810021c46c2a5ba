"""VeriCache greedy output == plain full-KV greedy output, token for token, for every compressor, on
the five bundled real prompts (1.9k-5.6k tokens), 64 new tokens, batched and single-request (a preset's
other ratio or bit width: the shortest prompt, 32 tokens; other horizons: the two shortest prompts)."""

from __future__ import annotations

import dataclasses

import pytest

from vericache_connector.compressors import PRESETS, get_compressor

pytestmark = pytest.mark.slow


# Another ratio or bit width of a method above: the same code paths (the compressor's maths at every setting is
# checked on random inputs in tests/unit), so on the real model the shortest prompt (graphlib_py, 1.9k tokens)
# and 32 tokens; kivi2 also runs three prompts with bfloat16 draft weights (test_draft_weights.py).
VARIANTS = {"snapkv-8x", "streamingllm-4x", "turboquant-k3v2", "kivi2"}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_identical_to_full_kv_greedy(engine, prefills, reference, shortest, greedy_cfg, preset):
    comp = get_compressor(preset)
    if preset in VARIANTS:
        greedy_cfg = dataclasses.replace(greedy_cfg, max_new_tokens=32)
        prefills, [ref] = shortest(1)
        reference = [ref[:32]]
    compressed = [comp.compress(p.prefix) for p in prefills]
    outs, stats = engine.generate(prefills, compressed, greedy_cfg)
    for i, (out, ref) in enumerate(zip(outs, reference)):
        assert len(out) == greedy_cfg.max_new_tokens
        assert out == ref, (
            f"{preset}: prompt {i} differs from full-KV greedy at token "
            f"{next(j for j, (a, b) in enumerate(zip(out, ref)) if a != b)}"
        )
    assert stats.mean_accepted() > 0.5, f"{preset}: drafts are almost never accepted"


@pytest.mark.parametrize(
    "preset,k,adaptive", [("snapkv-4x", 32, False), ("kivi4", 4, True), ("streamingllm-8x", 16, True)]
)
def test_identical_other_horizons(engine, shortest, greedy_cfg, preset, k, adaptive):
    cfg = dataclasses.replace(greedy_cfg, draft_k=k, adaptive=adaptive, k_min=2, k_max=32)
    # the two shortest prompts (1.9k, 2.6k tokens): these presets run all five at draft_k 8 above
    prefills, reference = shortest(2)
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


class _SlowArrival:
    """Stands in for a full KV copy that is still streaming: ready after `after` polls."""

    def __init__(self, after: int):
        self.polls, self.after, self.waited = 0, after, False

    def ready(self) -> bool:
        self.polls += 1
        return self.polls > self.after

    def wait(self) -> None:
        self.waited = True


def test_prefix_hit_with_suffix_and_late_full_kv(engine, prefills, reference, greedy_cfg):
    """A prefix-cache hit: the cache holds the first 1536 prompt tokens, the last ones are pending.
    Drafting starts from the compressed prefix before the full KV has 'arrived' (and goes on past
    draft_k while it streams); the first verify pass doubles as the suffix's prefill."""
    import torch

    from vericache_connector.engine.speculative import speculative_decode

    pre = prefills[0]
    stored = 1536
    prefix = engine.prefill(pre.prompt_ids[:stored])
    comp = get_compressor("kivi4").compress(prefix.prefix)
    extra = len(pre.prompt_ids) - stored + greedy_cfg.cache_headroom
    full, draft = engine.full_cache([prefix], extra), engine.draft_cache([comp], extra)
    arrival = _SlowArrival(after=20)
    suffix = torch.tensor([pre.prompt_ids[stored:]])
    outs, stats = speculative_decode(engine.model, full, draft, suffix, greedy_cfg, arrival=arrival)
    assert arrival.waited and stats.draft_lengths[0] > greedy_cfg.draft_k
    assert outs[0] == reference[0]
