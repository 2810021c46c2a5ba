"""Bounds of the decoding loop: a round never drafts more tokens than are still wanted nor past the
model's context, so a huge draft_k costs nothing extra (and the caches do not grow with it); NaN/inf
temperatures are refused. The output stays the full-KV output. The tiny random-weight model."""

from __future__ import annotations

import math

import pytest
import torch

from vericache_connector.compressors import get_compressor
from vericache_connector.engine import DecodeConfig
from vericache_connector.engine.speculative import speculative_decode

from tiny_model import tiny_engine


def prompt(n: int, seed: int = 0) -> list[int]:
    return [int(x) for x in torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed))]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -0.5])
def test_temperature_must_be_finite_and_not_negative(bad):
    with pytest.raises(ValueError, match="temperature"):
        DecodeConfig(temperature=bad)


def test_draft_horizon_takes_the_tightest_bound():
    from vericache_connector.engine.speculative import draft_horizon

    assert draft_horizon(k=10_000, wanted=5, room=100) == 4  # 4 drafts + the bonus = the 5 wanted
    assert draft_horizon(k=8, wanted=100, room=3) == 3
    assert draft_horizon(k=8, wanted=1, room=100) == 1  # never 0: a round drafts at least once


def test_cache_room_does_not_grow_with_k_max():
    small = DecodeConfig(max_new_tokens=16, draft_k=8)
    huge = DecodeConfig(max_new_tokens=16, draft_k=10_000, k_max=10_000)
    assert small.cache_headroom == huge.cache_headroom == 2 * 16 + 2


@pytest.mark.parametrize("adaptive", [False, True])
def test_huge_draft_k_drafts_only_what_is_wanted(adaptive):
    engine = tiny_engine()
    pres = [engine.prefill(prompt(40, s)) for s in (0, 1)]
    comp = [get_compressor("kivi4").compress(p.prefix) for p in pres]
    cfg = DecodeConfig(max_new_tokens=6, draft_k=500, k_min=2, k_max=500, adaptive=adaptive, stop_at_eos=False)
    outs, stats = engine.generate(pres, comp, cfg)
    assert outs == engine.generate_full(pres, cfg)
    assert max(stats.draft_lengths) <= 5  # the first token comes from the prefill: 5 more are wanted
    assert sum(stats.draft_lengths) <= 5 * len(stats.draft_lengths)


@pytest.mark.parametrize("layout", ["materialized", "dense", "packed", "paged"])
def test_rows_that_finish_early_stay_within_their_caches(layout):
    """Rows of unequal prompts accept different counts, so some finish rounds before others; the rounds
    that follow still write drafts into the finished rows: cache_headroom must cover them, whatever the
    layout (packed/paged draft caches size each row's room separately). Adaptive, huge k_max."""
    from vericache_connector.draft import DraftConfig

    engine = tiny_engine()
    g = torch.Generator().manual_seed(1)  # rows finish after 7, 6 and 9 rounds; row 0 idles 3 of them
    pres = [engine.prefill(torch.randint(0, 256, (n,), generator=g).tolist()) for n in (300, 451, 517)]
    comp = [get_compressor("streamingllm-8x").compress(p.prefix) for p in pres]
    cfg = DecodeConfig(max_new_tokens=24, draft_k=3, k_min=2, k_max=1000, adaptive=True, stop_at_eos=False)
    backend = {"backend": "ref"} if layout == "packed" else {}
    outs, stats = engine.generate(pres, comp, cfg, draft=DraftConfig(layout, **backend))
    assert outs == engine.generate_full(pres, cfg)
    assert len({len(a) for a in stats.accepted}) == 3  # the rows did finish in different rounds


class PositionSpy:
    """Stands in for the model: notes the highest position any forward (draft or verify) runs at."""

    def __init__(self, model):
        self.model, self.cfg, self.top = model, model.cfg, -1

    def __call__(self, ids, positions, cache, **kw):
        self.top = max(self.top, int(positions.max()))
        return self.model(ids, positions, cache, **kw)


def test_drafts_stop_at_the_models_context():
    """A prompt that leaves exactly max_new_tokens of context: no forward runs past its last position,
    even with caches that have room for more."""
    engine = tiny_engine(max_position=64)
    pre = engine.prefill(prompt(52))
    cfg = DecodeConfig(max_new_tokens=12, draft_k=32, k_max=32, stop_at_eos=False)
    full = engine.full_cache([pre], 64)
    draft = engine.draft_cache([get_compressor("int8").compress(pre.prefix)], 64)
    spy = PositionSpy(engine.model)
    outs, stats = speculative_decode(spy, full, draft, engine.first_tokens([pre], cfg), cfg)
    assert outs == engine.generate_full([pre], cfg)
    assert spy.top <= 63, spy.top
    assert max(stats.draft_lengths) <= 11
