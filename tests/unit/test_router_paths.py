"""Which path serves a request (router/paths.py: choose_path), on plain values: a table of what the router
knows of a request and its pools and the path it takes, as the routes and the decode took it before the rule
was one function (server.py: passed on; decode.py: plain / direct / alone / verified)."""

from __future__ import annotations

import time

import pytest

from vericache_connector.router.config import RouterConfig
from vericache_connector.router.paths import Pools, Request, Verifier, choose_path
from vericache_connector.router.upstream import Pool

IDLE, BUSY, DOWN = Verifier(), Verifier(saturated=True), Verifier(up=False)
FULL = Verifier(direct=2)  # both of 2 direct slots taken


@pytest.mark.parametrize(
    "request_, drafters, verifiers, slots, path, verifier",
    [
        # the routes: only the body, no prompt ids yet
        (Request(read=False, ids=False), 1, (IDLE,), 2, "passed", None),  # not read as vLLM reads it
        (Request(ids=False), 0, (IDLE,), 2, "passed", None),  # no drafter
        (Request(ids=False, greedy=False), 1, (IDLE,), 2, "passed", None),
        (Request(ids=False), 1, (IDLE,), 2, "direct", 0),  # not passed: the decode chooses again as it starts
        # the decode: the prompt's ids in hand
        (Request(greedy=False), 1, (IDLE,), 2, "plain", None),  # sampling
        (Request(), 0, (IDLE,), 2, "plain", None),  # no drafter
        (Request(), 1, (IDLE,), 2, "direct", 0),
        (Request(), 1, (Verifier(inflight=3), Verifier(direct=1, inflight=1), Verifier(inflight=1)), 2, "direct", 2),
        (Request(), 1, (Verifier(inflight=1), Verifier(direct=1)), 2, "direct", 0),  # a tie: the first
        (Request(), 1, (DOWN, BUSY, FULL, IDLE), 2, "direct", 3),  # down, saturated, slots taken: skipped
        (Request(), 1, (IDLE,), 0, "verified", None),  # no slots: never direct
        (Request(), 1, (FULL, Verifier(direct=2, inflight=9)), 2, "verified", None),
        (Request(), 1, (BUSY, BUSY), 2, "alone", None),  # every verifier saturated
        (Request(), 1, (BUSY, Verifier(up=False, direct=2)), 2, "alone", None),  # every one that is up
        (Request(), 1, (Verifier(up=False, saturated=True),) * 2, 2, "alone", None),  # none up: all of them
        (Request(), 1, (Verifier(up=False, saturated=True), DOWN), 2, "verified", None),
        (Request(), 1, (BUSY, FULL), 2, "verified", None),  # one up and not saturated, its slots taken
    ],
)
def test_the_path_each_request_takes(request_, drafters, verifiers, slots, path, verifier):
    choice = choose_path(request_, Pools(drafters, verifiers, slots))
    assert (choice.path, choice.verifier) == (path, verifier), choice.why
    assert choice.why


def test_what_the_router_sees_of_its_pools():
    """Pools.of reads the upstream pools: down (a fault within down_s), saturated (verify calls out, or slow
    lately: upstream.Server.saturated), the direct requests and verify calls out of each verifier."""
    cfg = RouterConfig(verifiers=[f"http://v{i}:8000" for i in range(4)], drafters=["http://d:8000"])
    verifiers = Pool.of(cfg.verifiers, "verifier", cfg.down_s)
    a, b, c, d = verifiers.servers
    verifiers.fault(a)
    b.inflight = cfg.max_verify_inflight
    c.verify_s, c.verify_at = cfg.verify_slow_s, time.monotonic()
    d.direct, d.inflight = 1, 2
    pools = Pools.of(cfg, Pool.of(cfg.drafters, "drafter", cfg.down_s), verifiers, 3)
    assert pools == Pools(
        1,
        (
            Verifier(up=False),
            Verifier(saturated=True, inflight=cfg.max_verify_inflight),
            Verifier(saturated=True),
            Verifier(direct=1, inflight=2),
        ),
        3,
    )


def test_the_proxy_places_a_new_prefix_beside_the_store_unless_that_is_busier():
    """Issue 53: requests passed on as they came (the replicas' prefix-aware proxy): a prefix stays on the server
    that served it (its prefix cache holds it); a new one goes to the near server (beside the store: it loads a
    stored prefix fastest) unless that has more passed-on requests out than the least busy other."""
    pool = Pool.of(["http://n:1", "http://f:1", "http://g:1"], "verifier", 10.0)
    near, *far = pool.servers
    near.near = True
    assert pool.place(1) is near
    near.passed = 1
    second = pool.place(2)
    assert second in far  # the near one is busier than a free far one
    second.passed = 1
    assert pool.place(1) is near and pool.place(2) is second  # held where they went
    other = next(s for s in far if s is not second)
    other.passed = 1
    assert pool.place(3) is near  # as busy as the least busy far one: beside the store wins
    pool.fault(near)
    assert pool.place(1) in far and pool.place(1) is pool.place(1)  # a server down hands its prefixes on, once
    assert pool.place(4, avoid={s.url for s in pool.servers}) is None
