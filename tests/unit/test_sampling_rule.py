"""The lossless rule (model/sampling.py) on random inputs against its definition: greedy acceptance from logits
and from a server's top tokens, nothing drafted, the emit rule's budget and EOS, and the shared settings."""

from __future__ import annotations

import pytest
import torch

from vericache_connector.engine.config import ServingConfig
from vericache_connector.engine.speculative import DecodeConfig
from vericache_connector.model.sampling import DecodeSettings, emit, verify


def reference_greedy(drafts: list[int], best: list[int]) -> tuple[int, int]:
    """The definition: accept while d_i == argmax z_{i-1}; then the argmax at the first mismatch (or after all)."""
    n = 0
    while n < len(drafts) and drafts[n] == best[n]:
        n += 1
    return n, best[n]


@pytest.mark.parametrize("k", [0, 1, 5, 16])
def test_greedy_verify_matches_its_definition_from_logits_and_from_top_tokens(k):
    g = torch.Generator().manual_seed(k)
    b, v = 64, 11
    logits = torch.randn(b, k + 1, v, generator=g)
    best = logits.argmax(-1)
    # drafts that agree for a random while, then differ
    agree = torch.randint(0, k + 1, (b,), generator=g)
    drafts = torch.where(torch.arange(k)[None] < agree[:, None], best[:, :k], (best[:, :k] + 1) % v)
    n, token = verify(drafts, logits)
    n2, token2 = verify(drafts, best)  # the same rule given only the top tokens
    for row in range(b):
        want = reference_greedy(drafts[row].tolist(), best[row].tolist())
        assert (int(n[row]), int(token[row])) == want == (int(n2[row]), int(token2[row]))
    assert torch.equal(n, agree)


def test_sampling_needs_logits_and_q():
    d = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="target logits"):
        verify(d, torch.zeros(1, 3, dtype=torch.long), temperature=1.0)
    with pytest.raises(ValueError, match="probabilities q"):
        verify(d, torch.zeros(1, 3, 5), temperature=1.0)


def test_sampling_with_nothing_drafted_samples_the_target():
    """k = 0 at temperature T: the token is one sample of softmax(z_0 / T) (chi-square on a small vocabulary)."""
    from scipy.stats import chisquare

    g = torch.Generator().manual_seed(0)
    z = torch.randn(1, 1, 6, generator=g) * 2
    rows = 20_000
    _, tok = verify(torch.zeros(rows, 0, dtype=torch.long), z.expand(rows, 1, 6), 0.7, None, g)
    p = torch.softmax(z[0, 0].double() / 0.7, -1)
    counts = torch.bincount(tok, minlength=6).double()
    assert chisquare(counts.numpy(), (p / p.sum() * rows).numpy()).pvalue > 1e-3


def test_emit_stops_at_the_budget_and_at_eos():
    out = [1]
    assert not emit(out, [2, 3], 5, eos=(9,))
    assert emit(out, [4, 5, 6], 5, eos=(9,)) and out == [1, 2, 3, 4, 5]  # the budget cuts 6
    out = []
    assert emit(out, [7, 9, 8], 10, eos=(9,)) and out == [7, 9]  # EOS is emitted, what follows dropped
    out = []
    assert not emit(out, [7, 9, 8], 10, eos=(9,), stop_at_eos=False) and out == [7, 9, 8]
    out = []
    assert emit(out, torch.tensor([3, 9]), 10, eos=(9,)) and out == [3, 9] and all(type(t) is int for t in out)


def test_one_base_for_the_decode_settings():
    assert issubclass(DecodeConfig, DecodeSettings) and issubclass(ServingConfig, DecodeSettings)
    for cls in (DecodeSettings, DecodeConfig, ServingConfig):
        with pytest.raises(ValueError, match="temperature"):
            cls(temperature=float("nan"))
        with pytest.raises(ValueError, match="temperature"):
            cls(temperature=-1)
        with pytest.raises(ValueError, match="k_min"):
            cls(k_min=0)
        with pytest.raises(ValueError, match="k_min"):
            cls(k_min=8, k_max=4)
    # each engine keeps its defaults: the serving engine ignores EOS so traces compare across policies
    assert (DecodeConfig().k_min, DecodeConfig().k_max, DecodeConfig().stop_at_eos) == (2, 32, True)
    assert (ServingConfig().k_min, ServingConfig().k_max, ServingConfig().stop_at_eos) == (4, 64, False)
