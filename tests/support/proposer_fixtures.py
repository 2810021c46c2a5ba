"""The proposer's unit tests' common ground (tests/unit/test_vllm_proposer.py, test_proposer_*.py): a tiny
random model with a 300-token prompt, its full-KV greedy output and the kivi4 copy of its first 256 tokens; a
CompressedKVProposer over that model as vLLM builds one; vLLM's propose arguments for token rows; a proposer
whose pre-draft ran. Imports vLLM (the proposer's logger): a test module imports this after its importorskip."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import torch
from fake_vllm_model import hf_config

from vericache_connector.compressors import get_compressor
from vericache_connector.engine import DecodeConfig
from vericache_connector.integration.vllm.proposer.draft_model import DraftModel
from vericache_connector.integration.vllm.proposer.proposer import CompressedKVProposer

from tiny_model import tiny_engine

PROMPT_LEN, PREFIX = 300, 256
K = 8


def proposer_setup():
    """(engine, prompt, its full-KV greedy output, the compressed copy of its first PREFIX tokens)."""
    eng = tiny_engine(seed=4, num_layers=3)
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 256, (PROMPT_LEN,), generator=g).tolist()
    ref = eng.generate_full([eng.prefill(prompt)], DecodeConfig(max_new_tokens=40, stop_at_eos=False))[0]
    compressed = get_compressor("kivi4").compress(eng.prefill(prompt[:PREFIX]).prefix)
    return eng, prompt, ref, compressed


def make_proposer(model, k: int = K) -> CompressedKVProposer:
    cfg = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k, prompt_lookup_min=None, prompt_lookup_max=None),
        model_config=SimpleNamespace(max_model_len=4096, hf_config=SimpleNamespace(to_dict=lambda: hf_config(model))),
    )
    return CompressedKVProposer(cfg)


def step_args(rows: list[list[int]]):
    width = max(len(r) for r in rows)
    ids = np.zeros((len(rows), width + 8), dtype=np.int32)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    return [[r[-1]] for r in rows], np.array([len(r) for r in rows]), ids


def predrafted(eng, compressed, prompt, drafts: int) -> CompressedKVProposer:
    """A proposer whose pre-draft for `prompt` ran `drafts` tokens, then the full copy landed."""
    p = make_proposer(eng.model)
    p.caches.draft = DraftModel.of_own(eng.model)
    loaded = threading.Event()
    p.predraft(prompt, PREFIX, compressed, loaded)
    deadline = time.monotonic() + 60
    while p.stats["predrafted"] < drafts and time.monotonic() < deadline:
        time.sleep(0.01)
    loaded.set()
    while any(c.predrafting for g in p.caches.groups.values() for c in g.chains):
        time.sleep(0.01)
    return p
