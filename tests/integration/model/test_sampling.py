"""Sampled VeriCache output has exactly the full-KV distribution (speculative rejection sampling)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from vericache_connector.compressors import get_compressor
from vericache_connector.engine.speculative import DecodeConfig, speculative_decode
from vericache_connector.model.sampling import verify


def empirical(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double()


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Chi-square goodness of fit; cells with small expectation are pooled into one."""
    n = counts.sum()
    expected = probs.double() * n
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    return float(
        chisquare(obs[keep].numpy(), exp[keep].numpy() * obs[keep].sum().item() / exp[keep].sum().item()).pvalue
    )


@pytest.mark.parametrize("k", [1, 3])
def test_rejection_sampler_emits_target_distribution(k):
    """Synthetic p != q on a 12-token vocabulary: the first emitted token (accepted draft or residual
    sample) must follow p_1, and with all drafts forced to be accepted the bonus follows p_{k+1}."""
    g = torch.Generator().manual_seed(0)
    v, n = 12, 200_000
    p = torch.softmax(torch.randn(k + 1, v, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(k, v, generator=g) * 2, -1)
    draft = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=g) for i in range(k)], 1)
    nacc, bonus = verify(draft, p.log().expand(n, k + 1, v), 1.0, q.expand(n, k, v), g)  # softmax(log p) = p
    first = torch.where(nacc > 0, draft[:, 0], bonus)
    assert chi2_pvalue(empirical(first, v), p[0]) > 1e-3
    # the test has power: the draft distribution itself is rejected
    assert chi2_pvalue(empirical(draft[:, 0], v), p[0]) < 1e-6
    # acceptance rate of the first draft is sum_x min(p, q)
    assert abs((nacc > 0).double().mean().item() - torch.minimum(p[0], q[0]).sum().item()) < 0.01


@pytest.mark.slow
def test_engine_sampling_matches_full_kv_distribution(engine):
    """End to end on the real model: 384 identical rows of a real prompt, drafting on a heavily
    compressed cache (StreamingLLM 8x); the first drafted-and-verified token is distributed exactly as
    the full-KV next-token distribution (temperature 1, top-48 tokens + the rest pooled)."""
    from vericache_connector.data import load_prompt

    ids = engine.encode(load_prompt("python_reference_docs"))[:160]
    pre = engine.prefill(ids)
    first_tok = int(pre.logits.argmax())
    rows = 384
    # exact target: the full-KV distribution after [prompt, first]
    cache = engine.full_cache([pre], 2)
    logits, _ = engine.model(torch.tensor([[first_tok]]), torch.tensor([[len(ids)]]), cache)
    p = torch.softmax(logits[0, -1].double(), -1)
    comp = get_compressor("streamingllm:ratio=8,sinks=4").compress(pre.prefix)
    draft_cache = engine.draft_cache([comp], 8)
    dlogits, _ = engine.model(torch.tensor([[first_tok]]), torch.tensor([[len(ids)]]), draft_cache)
    q = torch.softmax(dlogits[0, -1].double(), -1)
    assert 0.5 * (p - q).abs().sum() > 0.15, "draft too close to target: the test would have no power"

    cfg = DecodeConfig(max_new_tokens=3, draft_k=2, temperature=1.0, seed=1234, stop_at_eos=False)
    full = engine.full_cache([pre] * rows, 8)
    draft = engine.draft_cache([comp] * rows, 8)
    outs, _ = speculative_decode(engine.model, full, draft, torch.full((rows,), first_tok), cfg)
    second = torch.tensor([o[1] for o in outs])
    top = p.topk(48).indices
    remap = torch.full((p.shape[0],), 48, dtype=torch.long)
    remap[top] = torch.arange(48)
    p_bins = torch.cat([p[top], (1 - p[top].sum())[None]])
    q_bins = torch.cat([q[top], (1 - q[top].sum())[None]])
    counts = torch.bincount(remap[second], minlength=49).double()
    assert chi2_pvalue(counts, p_bins) > 1e-3
    assert chi2_pvalue(counts, q_bins) < 1e-3, "samples also fit the draft distribution: no power"
