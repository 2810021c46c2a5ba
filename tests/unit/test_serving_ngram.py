"""The model-free n-gram draft source (vericache_connector/draft/ngram.py) and its composition with the
compressed-KV drafts in the serving engine (ServingConfig.ngram): the index against hand-made contexts, and
rows over prompts that repeat themselves exact with proposals taken, on a tiny random model."""

from __future__ import annotations

import pytest
import torch

from vericache_connector.draft.ngram import NgramIndex
from vericache_connector.engine import DecodeConfig
from vericache_connector.engine.config import ServingConfig
from vericache_connector.engine.sequence import Request
from vericache_connector.engine.serving import ServingEngine

from tiny_model import tiny_engine


def test_index_proposes_what_followed_the_latest_longest_match():
    idx = NgramIndex([1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3], n_min=2, n_max=4)
    # the newest 3 tokens (1 2 3) occurred twice before: the latest (followed by 5 7) wins
    assert idx.propose([], 3) == [5, 7, 1]
    # the drafts are part of the suffix looked up: ... 1 2 3 4 -> what followed "2 3 4" (9 1 2)
    assert idx.propose([4], 3) == [9, 1, 2]
    assert idx.propose([8, 8], 4) == []  # "8 8" never occurred
    assert idx.propose([], 0) == []
    # only committed tokens enter the index: after the rejected drafts above, nothing about "8 8"
    idx.extend([8])
    assert idx.propose([8], 2) == [] and idx.tokens[-2:] == [3, 8]
    idx.extend([8, 6, 8])  # committed: ... 3 8 8 6 8
    assert idx.propose([8], 3) == [6, 8]  # "8 8" was followed by 6 8 (the context ends there)
    with pytest.raises(ValueError, match="n_min <= n_max"):
        NgramIndex([1], n_min=4, n_max=2)
    with pytest.raises(ValueError, match="ngram must be >= 0"):
        ServingConfig(ngram=-1)


def test_ngram_drafts_compose_with_compressed_kv_drafts_and_stay_exact():
    """Prompts that repeat a random block: proposals are taken (and verified like every draft), outputs equal
    each request's full-KV greedy output with and without them."""
    eng = tiny_engine(num_layers=4)
    g = torch.Generator().manual_seed(1)
    block = torch.randint(0, 256, (150,), generator=g).tolist()
    prompts = [block * 3, block * 2 + torch.randint(0, 256, (100,), generator=g).tolist()]
    refs = [eng.generate_full([eng.prefill(p)], DecodeConfig(max_new_tokens=30, stop_at_eos=False))[0] for p in prompts]
    drafted = {}
    for ngram in (0, 8):
        cfg = ServingConfig(policy="vericache", compressor="streamingllm-8x", k_max=16, ngram=ngram, tail_full=False)
        rep = ServingEngine(eng.model, cfg).run([Request(f"r{i}", p, 30) for i, p in enumerate(prompts)])
        assert [rep.outputs()[f"r{i}"] for i in range(2)] == refs
        drafted[ngram] = sum(r.ngram_drafted for r in rep.requests)
        assert rep.mean_accepted > 1.0
    assert drafted[0] == 0 and drafted[8] > 0
