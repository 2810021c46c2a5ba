"""The serving engine's planning pieces against hand-computed cases: the horizon choice, the acceptance
estimate, the two reservation rings, and the block manager's byte budget."""

from __future__ import annotations

import pytest
import torch

from vericache_connector.engine.block_manager import BlockManager, BudgetExceeded, KVPool
from vericache_connector.engine.planner import (
    AcceptanceEstimate,
    ReservationRings,
    choose_horizon,
    expected_tokens,
    reload_steps,
)


def test_expected_tokens_is_the_geometric_sum():
    for a in (0.3, 0.8, 0.95):
        for x in (0, 1, 5, 20):
            assert expected_tokens(a, x) == pytest.approx(sum(a**i for i in range(x + 1)))
    assert expected_tokens(1.0, 7) == 8


def test_horizon_grows_with_acceptance_and_reload_cost_and_respects_bounds():
    # a draft step costs about what a verify does (the same model): only the reload makes long horizons pay
    assert choose_horizon(0.95, 1, 64, 1.0, 0.0) == 1
    low = choose_horizon(0.5, 1, 64, 1.0, 10.0)
    high = choose_horizon(0.95, 1, 64, 1.0, 10.0)
    assert low < high
    assert choose_horizon(0.9, 1, 64, 1.0, 30.0) > choose_horizon(0.9, 1, 64, 1.0, 1.0)  # a costly reload: longer
    assert choose_horizon(0.5, 4, 64, 1.0, 0.0) == 4  # k_min
    assert choose_horizon(0.99, 1, 16, 1.0, 100.0) == 16  # k_max
    assert choose_horizon(0.5, 1, 64, 1.0, 0.0, link_min=40) == 40  # the link's share
    # the choice is the argmax of tokens per unit of cost
    a, cv, cr = 0.85, 1.0, 6.0
    x = choose_horizon(a, 1, 64, cv, cr)
    assert all(expected_tokens(a, x) / (x + cv + cr) >= expected_tokens(a, y) / (y + cv + cr) for y in range(1, 65))


def test_acceptance_estimate_moves_from_the_prior_to_what_is_seen():
    est = AcceptanceEstimate(prior=0.8, weight=8)
    assert est.alpha == pytest.approx(0.8)
    for _ in range(20):
        est.update(1, 4)  # one accepted, then a rejection: a = 1/2
    assert est.alpha == pytest.approx((6.4 + 20) / (6.4 + 20 + 1.6 + 20))
    est.update(8, 8)  # all accepted: no rejection counted
    assert est.rejected == 20


def test_rings_never_double_book_the_link_and_cap_staging_memory():
    rings = ReservationRings(window=100)
    placed = []
    for i in range(6):
        t = rings.place(now=0, earliest=5, lead=1, link_steps=3, nbytes=40, free_bytes=100, owner=f"r{i}")
        assert t is not None
        placed.append(t)
    # each reload holds the link for 3 slots starting one step before its verify: no slot twice
    slots = [s for t in placed for s in range(t - 1, t + 2)]
    assert len(slots) == len(set(slots))
    assert placed == sorted(placed) and placed[0] == 5
    assert max(rings.memory.values()) <= 100
    # staging that does not fit the free bytes is never placed
    assert rings.place(now=0, earliest=0, lead=1, link_steps=1, nbytes=101, free_bytes=100, owner="big") is None
    # releasing a reservation frees its slots and memory; a full window gives None
    rings.release("r0")
    assert "r0" not in rings.link.values() and rings.peak_memory(0) <= 100
    assert ReservationRings(window=3).place(0, 10, 1, 1, 1, 10, "late") is None


def test_reload_steps():
    assert reload_steps(1000, None, 0.1) == 1
    assert reload_steps(1000, 1000.0, 0.1) == 10
    assert reload_steps(1000, 1e9, 0.1) == 1


def pools(budget):
    full = KVPool("full", 2, 2, 32, 32, "float32", 16)
    draft = KVPool("draft", 2, 2, 32, 32, "float16", 16)
    return BlockManager({"full": full, "draft": draft}, budget)


def test_block_manager_enforces_one_budget_across_pools():
    bm = pools(budget=3 * 32768)
    assert bm.pools["full"].block_bytes == 2 * 2 * 2 * 32 * 32 * 4 == 32768
    a = bm.allocate("full", 2)
    b = bm.allocate("draft", 2)  # half the bytes each
    assert bm.used == 3 * 32768 and bm.peak == bm.used
    with pytest.raises(BudgetExceeded, match="do not fit"):
        bm.allocate("draft", 1)
    bm.free("full", a)
    bm.hold(2 * 32768)  # a prefill's transient layer: the budget is full again
    with pytest.raises(BudgetExceeded):
        bm.hold(1)
    bm.release(2 * 32768)
    ring = bm.allocate("full", 2, layers=1)  # a staging ring of 1 of 2 layers counts half
    assert bm.used == 32768 + 32768 and len(set(ring) | set(a)) == 2
    bm.free("full", ring, layers=1)
    bm.free("draft", b)
    assert bm.used == 0 and bm.peak == 3 * 32768


def test_pool_slots_and_round_trip():
    p = KVPool("full", 2, 2, 32, 32, "float32", 8)
    k, v = torch.randn(40, 2, 32), torch.randn(40, 2, 32)
    view = [5, 2]
    for layer in range(2):
        p.write(layer, p.slots(view, 0, 40), k, v)
    gk, gv = p.gather(1, view, 40)
    assert torch.equal(gk, k.transpose(0, 1)) and torch.equal(gv, v.transpose(0, 1))
    assert p.slots(view, 31, 2).tolist() == [5 * 32 + 31, 2 * 32]
    with pytest.raises(ValueError, match="past 2 blocks"):
        p.slots(view, 60, 5)


def test_verify_cost_adds_what_a_verify_step_costs_every_row():
    """The horizon's verify cost, in draft steps: cfg.verify_cost until both step kinds are measured, then
    plus the batch's rows times a verify step's extra time over a draft step (every row waits for it)."""
    from types import SimpleNamespace

    from vericache_connector.engine.config import ServingConfig
    from vericache_connector.engine.scheduler import Scheduler

    cfg = ServingConfig()
    unmeasured = SimpleNamespace(cfg=cfg, draft_s=0.1, verify_s=None)
    assert Scheduler.verify_cost(unmeasured, 4) == cfg.verify_cost
    measured = SimpleNamespace(cfg=cfg, draft_s=0.1, verify_s=0.25)
    assert Scheduler.verify_cost(measured, 4) == pytest.approx(cfg.verify_cost + 4 * 1.5)
    cheaper = SimpleNamespace(cfg=cfg, draft_s=0.1, verify_s=0.05)  # noise: never below the configured cost
    assert Scheduler.verify_cost(cheaper, 4) == cfg.verify_cost
