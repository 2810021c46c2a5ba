"""`vericache router`'s /metrics (router/observe.py) against stand-in upstream servers: what it answered and how."""

from __future__ import annotations

import asyncio

import pytest

aiohttp = pytest.importorskip("aiohttp")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from router_fakes import VOCAB, Fake, Stack  # noqa: E402

PROMPT = [(i * 7919) % VOCAB for i in range(300)]
BODY = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}


def samples(text: str) -> dict[tuple, float]:
    return {
        (x.name, tuple(sorted(x.labels.items()))): x.value
        for f in text_string_to_metric_families(text)
        for x in f.samples
        if x.name.startswith("vericache_router_")
    }


def test_the_routers_metrics_count_what_it_answered_and_how():
    verifier = Fake("verifier")

    async def go():
        async with Stack([("v", verifier)], [("d", Fake("drafter")), ("denied", Fake("drafter", deny=True))]) as st:
            served = [await st.post({**BODY, "prompt": PROMPT[: 250 + j] + [j]}) for j in range(6)]
            served.append(await st.post({**BODY, "temperature": 0.7}))  # sampling: passed to the verifier
            async with aiohttp.ClientSession() as s, s.get(st.url + "/metrics") as r:
                return served, r.status, await r.text()

    served, status, text = asyncio.run(go())
    got = samples(text)
    paths = [a["vericache"]["path"] for a in served[:6]]
    route = ("route", "/v1/completions")
    assert status == 200
    for path in ("verified", "fallback"):
        assert got[("vericache_router_requests_total", (("path", path), route))] == paths.count(path)
    assert paths.count("fallback") >= 1 and got[("vericache_router_requests_total", (("path", "passed"), route))] == 1
    assert got[("vericache_router_fallbacks_total", (("role", "drafter"),))] == paths.count("fallback")
    assert got[("vericache_router_upstream_auth_failures_total", ())] >= 1  # the drafter that refuses the token
    calls = sum(a["vericache"]["verify_calls"] for a in served[:6])
    assert calls > 0 and got[("vericache_router_verify_calls_total", ())] == calls
    assert got[("vericache_router_accepted_drafts_count", ())] == calls
    assert got[("vericache_router_request_seconds_count", (route,))] == 7
    assert got[("vericache_router_verify_queue", ())] == 0
