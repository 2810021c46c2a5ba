"""When the proposer drafts (pacing.py, no model): the DraftPacer drafts only where drafts raise the batch's
rate from measured step and draft times, fetches a compressed copy only where its pre-drafts save more than it
delays the full copy, and measures what a second of pre-drafting is worth; the BatchSwitch keeps drafting only
where it measurably raises vLLM's output."""

from __future__ import annotations

import pytest

from vericache_connector.engine.planner import AcceptanceEstimate
from vericache_connector.integration.vllm.proposer.pacing import DraftPacer


def test_the_pacer_drafts_only_where_it_pays():
    est = AcceptanceEstimate(0.8)
    pacer = DraftPacer(k_max=16)
    assert pacer.horizon(est, 16) == 0  # nothing measured yet: vLLM's step first
    t = 0.0
    for _ in range(5):  # vLLM steps of 100 ms without drafts
        pacer.propose_ended(0, now=t)
        t += 0.1
        pacer.propose_started(now=t)
    assert pacer.horizon(est, 16) == 1  # one draft step to measure it
    pacer.drafted(0.1)  # a draft step costs a vLLM step (the CPU, weights dominate): never pays
    assert pacer.horizon(est, 16) == 0
    assert pacer.horizon(AcceptanceEstimate(0.99, accepted=1000), 16) == 0
    cheap = DraftPacer(k_max=16)
    for _ in range(5):
        cheap.record_step(0.1)
    cheap.drafted(0.005)  # 20x cheaper drafts (a GPU, a long context): pays, several per step
    assert cheap.horizon(est, 16) >= 3
    assert cheap.horizon(AcceptanceEstimate(0.2, rejected=1000), 16) == 0  # rejected almost always: off


def test_drafting_stops_at_a_batch_where_a_verify_step_costs_more_than_it_saves():
    """Measured (stubbed): a vLLM step over 1 request 100 ms, over 8 requests 160 ms (batching amortizes the
    weights); a draft step 20 ms; a verified draft adds 10 ms. Alone, a request's drafts pay; in a batch of 8
    each draft delays 8 requests and must save 8 times its cost: none are drafted, and already-made drafts
    (pre-drafts, n-gram matches) only where their acceptance is high enough."""
    pacer = DraftPacer(k_max=16)
    for _ in range(5):
        pacer.record_step(0.100, rows=1)
        pacer.record_step(0.160, rows=8)
        pacer.record_step(0.100 + 4 * 0.010, rows=1, drafts=4)
    pacer.drafted(0.020)
    assert pacer.per_draft_s == pytest.approx(0.010)
    est = AcceptanceEstimate(0.8)
    assert pacer.horizon(est, 16, batch=1) >= 2 and pacer.horizon(est, 16, batch=8) == 0
    assert pacer.free_horizon(est, 16, batch=1) >= 2 and pacer.free_horizon(est, 16, batch=8) == 0
    assert pacer.free_horizon(AcceptanceEstimate(0.97, accepted=1000), 16, batch=8) >= 2
    assert pacer.step_s(4) == pytest.approx(0.100 + 3 * 0.060 / 7)  # between the sizes measured


def test_the_cost_of_a_draft_is_what_drafts_added_in_all_not_the_typical_steps_share():
    """Steps of 8 rows take 80 ms; with 8 drafts four took 110 ms and one 150 ms (a step's time is skewed: an
    occasional slow one). The drafts cost the server 190 ms over 40 drafts, 4.75 ms each: the median step's
    3.75 ms would propose drafts that cost more than they save. A step of one draft weighs one draft."""
    pacer = DraftPacer(k_max=16)
    for _ in range(5):
        pacer.record_step(0.080, rows=8)
    for extra in (0.030, 0.030, 0.030, 0.030, 0.070):
        pacer.record_step(0.080 + extra, rows=8, drafts=8)
    assert pacer.per_draft_s == pytest.approx(0.190 / 40)
    pacer.record_step(0.080 + 0.040, rows=8, drafts=1)  # noise, mostly: it moves the estimate by its one draft
    assert pacer.per_draft_s == pytest.approx(0.230 / 41)


def test_the_compressed_copy_is_fetched_only_where_its_drafts_save_more_than_it_delays():
    pacer = DraftPacer(k_max=32)
    assert pacer.worth_predraft(None, 64) and pacer.worth_predraft(5.0, 64)  # nothing measured: fetch and learn
    for _ in range(5):  # vLLM steps of 100 ms
        pacer.record_step(0.1)
    for n in (5, 5, 5):
        pacer.predraft_yield(n)  # vLLM accepted 5 pre-drafted tokens per request: 0.5 s saved
    assert pacer.worth_predraft(0.3, 64)  # the copy delays the full copy by 0.3 s: fetch
    assert not pacer.worth_predraft(1.0, 64)  # by 1 s: do not
    assert not pacer.worth_predraft(0.3, 3)  # 2 tokens left to save at most: do not


def test_a_split16_pre_draft_runs_only_where_the_rest_of_the_load_leaves_room_for_draft_steps():
    pacer = DraftPacer(k_max=32)
    assert pacer.worth_predraft_during(0.01)  # nothing measured: draft and learn
    for _ in range(5):  # vLLM steps of 100 ms, no draft step measured yet
        pacer.record_step(0.1)
    assert pacer.worth_predraft_during(0.5) and not pacer.worth_predraft_during(0.2)
    pacer.drafted(0.05)  # draft steps of 50 ms: room for WINDOW_STEPS of them in 0.2 s
    assert pacer.worth_predraft_during(0.2) and not pacer.worth_predraft_during(0.1)


def test_the_worth_of_a_second_of_pre_drafting_is_measured():
    """What the connector's load-or-recompute decision credits a load with: decode seconds the pre-drafts
    saved (accepted tokens x vLLM's step alone) per second spent pre-drafting."""
    pacer = DraftPacer(k_max=16)
    pacer.predraft_yield(40, 6.0)
    assert pacer.predraft_value() is None  # vLLM's step not measured yet
    for _ in range(3):
        pacer.record_step(0.09, rows=1)
    pacer.predraft_yield(20, 6.0)
    assert pacer.predraft_value() == pytest.approx((40 + 20) * 0.09 / 12.0)


def test_the_batch_switch_keeps_drafting_only_where_it_measurably_raises_the_output():
    """Per batch size, tokens per second of steps with drafts against steps without: alternating runs until
    both are measured, then the winner, with short runs of the other arm to notice a change."""
    from vericache_connector.integration.vllm.proposer.pacing import BatchSwitch

    sw = BatchSwitch()
    first = [sw.allows(1) for _ in range(16)]
    assert first == [True] * 4 + [False] * 4 + [True] * 4 + [False] * 4 and sw.pays(1) is None
    for _ in range(8):
        sw.record(1, True, 3, 0.1)  # alone: drafts give 3 tokens a step of 100 ms
        sw.record(1, False, 1, 0.05)  # ... against 1 in 50 ms
        sw.record(8, True, 9, 0.3)  # a batch of 8: 9 tokens in 300 ms
        sw.record(6, False, 8, 0.16)  # ... against 8 in 160 ms (the same bucket, 5-8)
    assert sw.pays(1) is True and sw.pays(8) is False and sw.bucket(6) == sw.bucket(8) != sw.bucket(4)
    alone, busy = [sw.allows(1) for _ in range(64)], [sw.allows(8) for _ in range(64)]
    assert sum(alone) == 64 - 2 * BatchSwitch.EXPLORE_RUN and sum(busy) == 2 * BatchSwitch.EXPLORE_RUN
    assert "<=1: 30.0 / 20.0 tok/s" in sw.describe() and "<=8: 30.0 / 50.0 tok/s" in sw.describe()
