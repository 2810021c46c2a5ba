"""`vericache router`'s path "direct" (issue 39): while a verifier has a free decode slot
(--verifier-decode-slots N), a greedy request is decoded there by itself, no drafts, and answers the
verifier's own greedy output; once N are in flight the next one is drafted and verified as before. Against
stand-in upstream servers (tests/support/router_fakes.py: no model, no vLLM)."""

from __future__ import annotations

import argparse
import asyncio
import logging

import pytest

aiohttp = pytest.importorskip("aiohttp")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from vericache_connector.router.config import RouterConfig, add_router_args, config_from_args  # noqa: E402
from vericache_connector.router.decode import RoutedDecode, Wanted  # noqa: E402
from vericache_connector.router.slots import DirectSlots  # noqa: E402
from vericache_connector.router.upstream import Pool  # noqa: E402

from router_fakes import VOCAB, Fake, Stack, greedy  # noqa: E402

PROMPT = [(i * 7919) % VOCAB for i in range(300)]
BODY = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "return_token_ids": True}


def run(coro):
    return asyncio.run(coro)


def ids_of(got: dict) -> list[int]:
    return got["ids"] if "ids" in got else got["choices"][0]["token_ids"]


def served_of(got: dict) -> dict:
    return got["last"]["vericache"] if "ids" in got else got["vericache"]


async def until(cond, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.005)


@pytest.mark.parametrize("stream", [False, True])
def test_a_free_slot_decodes_a_greedy_request_on_the_verifier_by_itself(stream, caplog):
    verifier, drafter = Fake("verifier"), Fake("drafter")

    async def go():
        async with Stack([("v", verifier)], [("d", drafter)], verifier_decode_slots=1) as st:
            got = await st.post({**BODY, "stream": stream})
            async with aiohttp.ClientSession() as s, s.get(st.url + "/metrics") as r:
                metrics = await r.text()
            return got, metrics, st.router.verifiers.servers[0].direct

    with caplog.at_level(logging.INFO, logger="vericache.router"):
        got, metrics, slots_taken = run(go())
    assert got["status"] == 200 and ids_of(got) == greedy(PROMPT, 40)  # the verifier's own greedy output
    served = served_of(got)
    assert served["path"] == "direct" and served["verify_calls"] == 0 and served["verifier"] == verifier.url
    assert verifier.streams == 1 and not verifier.calls and drafter.streams == 0 and not drafter.bodies
    assert "kv_transfer_params" not in verifier.bodies[0]  # the verifier's connector loads the full copy
    assert slots_taken == 0
    assert any("new tokens, direct," in r.getMessage() for r in caplog.records)  # the router's line per request
    counted = {
        x.labels["path"]: x.value
        for f in text_string_to_metric_families(metrics)
        for x in f.samples
        if x.name == "vericache_router_requests_total"
    }
    assert counted == {"direct": 1.0}


def test_with_every_slot_taken_the_next_request_is_drafted_and_verified():
    verifier, drafter = Fake("verifier"), Fake("drafter")
    long = {**BODY, "max_tokens": 1000}  # ~2 ms a token at the stand-in: seconds in flight

    async def go():
        async with Stack([("v", verifier)], [("d", drafter)], verifier_decode_slots=2) as st:
            first = [asyncio.create_task(st.post(long)) for _ in range(2)]
            await until(lambda: verifier.streams == 2)
            third = await st.post({**BODY, "max_tokens": 8})
            return await asyncio.gather(*first), third, st.router.verifiers.servers[0].direct

    first, third, slots_taken = run(go())
    assert [served_of(a)["path"] for a in first] == ["direct", "direct"]
    assert all(ids_of(a) == greedy(PROMPT, 1000) for a in first)
    assert served_of(third)["path"] == "verified" and served_of(third)["verify_calls"] >= 1
    assert ids_of(third) == greedy(PROMPT, 8) and drafter.streams >= 1
    assert slots_taken == 0


def test_no_slots_never_go_direct():
    verifier, drafter = Fake("verifier"), Fake("drafter")

    async def go():
        async with Stack([("v", verifier)], [("d", drafter)], verifier_decode_slots=0) as st:
            return [await st.post({**BODY, "max_tokens": 8, "stream": s}) for s in (False, True)]

    answers = run(go())
    assert [served_of(a)["path"] for a in answers] == ["verified", "verified"]
    assert verifier.streams == 0 and len(verifier.calls) >= 2  # no plain decoding on the verifier, only verify calls


@pytest.mark.parametrize("stream", [False, True])
def test_a_direct_request_whose_verifier_dies_is_finished_by_another(stream):
    dies, other = Fake("verifier", cut_after=10), Fake("verifier")  # dies: the first of the two idle ones

    async def go():
        async with Stack([("dies", dies), ("v", other)], [("d", Fake("drafter"))], verifier_decode_slots=1) as st:
            got = await st.post({**BODY, "stream": stream})
            return got, [s.direct for s in st.router.verifiers.servers], st.router.verifiers.servers[0].down_until

    got, slots_taken, down_until = run(go())
    assert got["status"] == 200 and ids_of(got) == greedy(PROMPT, 40)
    served = served_of(got)
    assert served["path"] == "fallback" and served["cause"].startswith("verifier " + dies.url), served
    assert served["verifier"] == other.url and dies.streams == 1 and other.streams == 1
    assert slots_taken == [0, 0] and down_until > 0  # the slot given back; the verifier that died marked down


def test_a_direct_slot_is_released_whatever_ends_the_request():
    """A refused input (vLLM's 400: back to the client), a client that goes away, a verifier that fails with no
    other to finish on: the slot comes back each time, so the next request still goes direct (1 slot)."""
    verifier = Fake("verifier", refused={PROMPT[5]})

    async def go():
        async with Stack([("v", verifier)], [("d", Fake("drafter"))], verifier_decode_slots=1) as st:
            slot = st.router.verifiers.servers[0]
            refused = await st.post({**BODY, "stream": True})
            assert refused["last"]["error"]["message"] == f"Token id {PROMPT[5]} is refused" and slot.direct == 0
            prompt = PROMPT[10:]  # no refused token
            async with aiohttp.ClientSession() as s:
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(0.5):
                        await s.post(st.url + "/v1/completions", json={**BODY, "prompt": prompt, "max_tokens": 2000})
            await until(lambda: slot.direct == 0)  # the router notices within 0.25 s
            assert verifier.streams == 2  # it had gone direct
            verifier.cut_after = 3  # it now dies mid-stream, every time: nothing can finish the request
            failed = await st.post({**BODY, "prompt": prompt})
            assert failed["status"] == 502 and slot.direct == 0
            verifier.cut_after, slot.down_until = None, 0.0  # it is back
            return await st.post({**BODY, "prompt": prompt})

    last = run(go())
    assert served_of(last)["path"] == "direct" and ids_of(last) == greedy(PROMPT[10:], 40)


def test_the_free_verifier_is_up_not_saturated_and_the_least_busy():
    cfg = RouterConfig(verifiers=[f"http://v{i}:8000" for i in range(3)], drafters=["http://d:8000"])
    verifiers = Pool.of(cfg.verifiers, "verifier", cfg.down_s)
    a, b, c = verifiers.servers
    decode = RoutedDecode(cfg, None, Pool.of(cfg.drafters, "drafter", 1.0), verifiers, PROMPT, Wanted(8))
    a.inflight, b.direct, c.inflight = 3, 0, 1

    def free():  # the verifier the request would decode on by itself (path "direct"), or None
        choice = decode.choose()
        return None if choice.verifier is None else verifiers.servers[choice.verifier]

    assert free() is b  # fewest direct + verify calls out
    verifiers.fault(b)
    assert free() is c  # b is down
    c.inflight = cfg.max_verify_inflight
    assert free() is a  # c is saturated
    a.direct = cfg.verifier_decode_slots
    assert free() is None and decode.choose().path == "verified"  # a's slots are taken: draft and verify


def test_the_slots_are_a_checked_option():
    p = argparse.ArgumentParser()
    add_router_args(p)
    cfg = config_from_args(p.parse_args(["--verifier", "http://v:8000"]))
    assert cfg.verifier_decode_slots == 8 and cfg.max_verifier_decode_slots == 16
    args = p.parse_args(["--verifier", "http://v:8000", "--verifier-decode-slots", "20"])
    assert config_from_args(args).max_verifier_decode_slots == 20  # the default most, or the count if higher
    args = p.parse_args(
        ["--verifier", "http://v:8000", "--verifier-decode-slots", "2", "--max-verifier-decode-slots", "2"]
    )
    assert config_from_args(args).max_verifier_decode_slots == 2  # a fixed count
    with pytest.raises(
        ValueError, match=r"max_verifier_decode_slots must be an integer >= verifier_decode_slots \(3\)"
    ):
        RouterConfig(verifiers=["http://v:8000"], verifier_decode_slots=3, max_verifier_decode_slots=2)
    args = p.parse_args(["--verifier", "http://v:8000", "--verifier-decode-slots", "0"])
    assert config_from_args(args).verifier_decode_slots == 0
    for bad in (-1, True, 1.5, "2"):
        with pytest.raises(ValueError, match=f"verifier_decode_slots must be an integer >= 0, got {bad!r}"):
            RouterConfig(verifiers=["http://v:8000"], verifier_decode_slots=bad)


def test_the_direct_slots_follow_what_the_finished_requests_measured():
    """router/slots.py: a direct request about as fast as the drafted ones go (or faster) adds a slot, up to the
    most; direct requests slower than drafted ones take one away, down to 1; with no drafted request measured
    yet the first direct request's rate stands in; a fixed count (most == initial) or 0 never moves."""
    s = DirectSlots(1, 3)
    s.observe("direct", 40, 4.0)  # 10 tok/s, nothing to compare with but itself
    assert s.limit == 2
    s.observe("verified", 40, 8.0)  # 5 tok/s drafted
    s.observe("direct", 40, 5.0)  # 8 tok/s: still faster
    s.observe("direct", 40, 5.0)
    assert s.limit == 3  # the most
    for _ in range(6):  # the verifier slows under its direct requests: 2 tok/s each
        s.observe("direct", 40, 20.0)
    assert s.limit == 1  # handed back to the drafters, one at a time, never below 1
    s.observe("alone", 40, 1.0)  # other paths are not counted
    assert s.limit == 1 and s.rate["direct"] < 5.0
    alone = DirectSlots(1, 4)  # no drafted request yet: the first direct rate is the bar
    alone.observe("direct", 40, 4.0)
    for _ in range(8):
        alone.observe("direct", 40, 16.0)  # 2.5 tok/s against the first 10
    assert alone.limit == 1
    fixed, off = DirectSlots(2, 2), DirectSlots(0, 8)
    for s in (fixed, off):
        s.observe("verified", 40, 40.0)
        s.observe("direct", 40, 1.0)
    assert (fixed.limit, off.limit) == (2, 0)
    with pytest.raises(ValueError, match=r"the most direct slots \(1\) must be >= the initial count \(2\)"):
        DirectSlots(2, 1)


def test_the_router_grows_its_direct_slots_from_its_requests():
    """Through the router: a request decoded on the verifier by itself (nothing to compare it with but itself)
    adds a slot, up to the most (its answer says the count); then two at once both go direct, and /metrics shows
    the count the router holds."""
    verifier, drafter = Fake("verifier"), Fake("drafter")

    async def go():
        async with Stack(
            [("v", verifier)], [("d", drafter)], verifier_decode_slots=1, max_verifier_decode_slots=2
        ) as st:
            first = served_of(await st.post(BODY))
            both = await asyncio.gather(st.post(BODY), st.post(BODY))
            async with aiohttp.ClientSession() as s, s.get(st.url + "/metrics") as r:
                metrics = await r.text()
            return first, both, metrics, st.router.slots.limit

    first, both, metrics, limit = run(go())
    assert first["path"] == "direct" and first["direct_slots"] == 2
    assert [served_of(x)["path"] for x in both] == ["direct", "direct"]
    assert all(ids_of(x) == greedy(PROMPT, 40) for x in both)
    assert drafter.streams == 0
    gauge = [
        x.value
        for f in text_string_to_metric_families(metrics)
        for x in f.samples
        if x.name == "vericache_router_direct_slots"
    ]
    assert gauge == [float(limit)] and limit in (1, 2)
