"""The draft-sending rule (model/draft_rule.py) on its own: when a drafter sends its drafts for verification and
how many, the one rule of the ZeroMQ drafter (remote/drafter.py) and the router (router/draft_loop.py)."""

from __future__ import annotations

import pytest

from vericache_connector.model import DraftRule
from vericache_connector.model.draft_rule import eos_ahead

EOS = 7


def test_the_rule_follows_the_cost_of_a_call():
    """A cheap call (the verifier keeps the request's KV) goes out at k_min, a prefill per call at draft_k; a
    call carries at most max(k_max, draft_k), under the transport's limit where it has one."""
    assert DraftRule.of(2, 32, 16, cheap_calls=True) == DraftRule(send_at=2, k_cap=32)
    assert DraftRule.of(2, 32, 16, cheap_calls=False) == DraftRule(send_at=16, k_cap=32)
    assert DraftRule.of(2, 8, 16, cheap_calls=True).k_cap == 16  # draft_k above k_max
    assert DraftRule.of(2, 512, 16, cheap_calls=True, most=256).k_cap == 256
    for name, bad in (("send_at", 0), ("k_cap", -1), ("send_at", 2.0), ("k_cap", True)):
        with pytest.raises(ValueError, match=rf"{name} must be an integer >= 1, got {bad!r}"):
            DraftRule(**{"send_at": 2, "k_cap": 8, name: bad})


@pytest.mark.parametrize(
    "spec, budget, more, stop_at_eos, ready",
    [
        ([1], 30, True, True, False),  # one ready, more coming: wait for send_at
        ([1, 2, 3], 30, True, True, True),  # send_at ready
        ([1], 2, True, True, True),  # the budget leaves room for one draft only (a call emits one more)
        ([], 1, True, True, True),  # no room for drafts at all: the call carries none
        ([1], 30, False, True, True),  # the stream can give no more
        ([EOS], 30, True, True, True),  # an EOS drafted: nothing past it is emitted
        ([EOS], 30, True, False, False),  # ... unless EOS does not end the request
        ([1] * 4, 30, True, True, True),  # k_cap reached (send_at above it cannot be waited for)
    ],
)
def test_when_a_call_goes_out(spec, budget, more, stop_at_eos, ready):
    rule = DraftRule(send_at=3, k_cap=4) if len(spec) != 4 else DraftRule(send_at=8, k_cap=4)
    assert rule.ready(spec, budget, more, {EOS}, stop_at_eos) is ready


@pytest.mark.parametrize(
    "spec, budget, stop_at_eos, count",
    [
        ([1, 2, 3], 30, True, 3),  # all of them
        ([1, 2, 3, 4, 5, 6], 30, True, 4),  # at most k_cap
        ([1, 2, 3], 3, True, 2),  # at most budget - 1: the verdict adds a token
        ([1, 2, 3], 1, True, 0),
        ([], 30, True, 0),
        ([1, EOS, 3], 30, True, 2),  # through the first EOS
        ([1, EOS, 3], 30, False, 3),  # EOS does not end the request
    ],
)
def test_how_many_a_call_carries(spec, budget, stop_at_eos, count):
    assert DraftRule(send_at=2, k_cap=4).count(spec, budget, {EOS}, stop_at_eos) == count


def test_eos_ahead():
    assert eos_ahead([1, EOS, 2], {EOS}) and not eos_ahead([1, EOS], {EOS}, stop_at_eos=False)
    assert not eos_ahead([1, 2], {EOS}) and not eos_ahead([], {EOS})
