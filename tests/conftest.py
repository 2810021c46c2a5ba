"""Shared fixtures: the real model (SmolLM2-135M, float32, CPU) and the bundled long prompts, prefilled
once per session; the full-KV greedy reference outputs are computed once and reused by every test."""
from __future__ import annotations

import pytest
import torch

from vericache_connector.speculative import DecodeConfig

NEW_TOKENS = 64


@pytest.fixture(scope="session")
def engine():
    from vericache_connector.engine import VeriCacheEngine

    torch.manual_seed(0)
    return VeriCacheEngine.from_pretrained()


@pytest.fixture(scope="session")
def prefills(engine):
    """The five bundled real prompts (1.9k-5.6k tokens), prefilled on the full KV."""
    from vericache_connector.prompts import load_prompts

    return [engine.prefill(engine.encode(text)) for text in load_prompts().values()]


@pytest.fixture(scope="session")
def greedy_cfg():
    return DecodeConfig(max_new_tokens=NEW_TOKENS, draft_k=8, stop_at_eos=False)


@pytest.fixture(scope="session")
def reference(engine, prefills, greedy_cfg):
    """Plain full-KV greedy decoding, one token at a time: what VeriCache must reproduce exactly."""
    return engine.generate_full(prefills, greedy_cfg)
