"""`vericache router` against stand-in upstream servers on 127.0.0.1 (no model, no vLLM): the draft / verify
loop must emit exactly the verifier's greedy tokens, whatever the drafter drafts and whatever faults occur.

The stand-ins speak the vLLM API the router uses. The "model" is a fixed function: the verifier's greedy
token after a sequence is truth(seq); the drafter drafts truth(seq) too, except at positions where
`wrong(pos)` holds (a rejected draft there). A drafter can also stop mid-stream or never answer, and a
verifier can fail or be slow: the answer must still be truth's continuation, token for token.
"""

from __future__ import annotations

import asyncio

import pytest

aiohttp = pytest.importorskip("aiohttp")

from vericache_connector.router.config import RouterConfig, router_token  # noqa: E402
from vericache_connector.router.server import Router, make_app  # noqa: E402

from router_fakes import TOKEN, VOCAB, Detok, Fake, greedy, routed, serve  # noqa: E402

PROMPT = [(i * 7919) % VOCAB for i in range(300)]
BODY = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
WANT = greedy(PROMPT, 40)


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("stream", [False, True])
def test_verified_output_is_the_verifiers_greedy_output_with_rejected_drafts(stream):
    drafter = Fake("drafter", wrong=lambda pos: pos % 9 == 4)  # a wrong draft every 9 tokens
    verifier = Fake("verifier")
    got = run(routed([("v", verifier)], [("d", drafter)], {**BODY, "stream": stream}))
    assert got["status"] == 200
    ids = got["ids"] if stream else got["choices"][0]["token_ids"]
    served = got["last"]["vericache"] if stream else got["vericache"]
    assert ids == WANT
    assert served["path"] == "verified" and served["verify_calls"] == len(verifier.calls) >= 4
    assert any(n < d for n, (_, d) in zip(served["accepted"], verifier.calls)), "some drafts must be rejected"
    assert drafter.streams > 1 and set(drafter.auth) == {f"Bearer {TOKEN}"}  # restarted after rejections
    assert verifier.calls[0] == (len(PROMPT), 0)  # the opening call: no drafts


@pytest.mark.parametrize("prompt_len", [300, 6000])  # 6000: answers of ~0.5 MB, read in many pieces
def test_verify_calls_through_prompt_logprobs_carry_draft_k_drafts(prompt_len):
    verifier = Fake("verifier")
    prompt = [(i * 7919) % VOCAB for i in range(prompt_len)]
    got = run(routed([("v", verifier)], [("d", Fake("drafter", wrong=lambda p: p % 13 == 0))],
                     {**BODY, "prompt": prompt}, verify_api="prompt-logprobs", draft_k=6))  # fmt: skip
    assert got["choices"][0]["token_ids"] == greedy(prompt, 40) and got["vericache"]["path"] == "verified"
    assert len(verifier.calls) == got["vericache"]["verify_calls"] >= 3


def test_calls_with_the_route_carry_at_most_k_max_drafts():
    verifier = Fake("verifier")
    got = run(routed([("v", verifier)], [("d", Fake("drafter"))], BODY, k_min=2, k_max=8))
    assert got["choices"][0]["token_ids"] == WANT
    assert 0 < max(d for _, d in verifier.calls) <= 8


def test_eos_ends_the_request_as_the_verifier_would():
    prompt = [3, 1, 4, 1, 5]
    seq = greedy(prompt, 30)
    body = {**BODY, "prompt": prompt, "ignore_eos": False, "max_tokens": 30}
    eos = seq[10]  # make the 11th greedy token the end of sequence

    async def go():
        runners = []
        v, d = Fake("verifier"), Fake("drafter")
        (rv, uv), (rd, ud) = await serve(v.app()), await serve(d.app())
        router = Router(
            RouterConfig(verifiers=[uv], drafters=[ud], tokenizer="x", verifier_decode_slots=0), TOKEN.encode()
        )
        router.tokenizer, router.eos, router.name = Detok(), frozenset({eos}), "fake"
        rr, url = await serve(make_app(router))
        runners += [rv, rd, rr]
        try:
            async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
                return await r.json()
        finally:
            for x in runners:
                await x.cleanup()

    got = run(go())
    assert got["choices"][0]["token_ids"] == seq[: seq.index(eos) + 1]
    assert got["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "fault, drafters, verifiers, cause",
    [
        ("drafter down", [("d", None)], [("v", Fake("verifier"))], "drafter"),
        ("drafter dies mid-stream", [("d", Fake("drafter", cut_after=5))], [("v", Fake("verifier"))], "drafter"),
        ("verifier dies", [("d", Fake("drafter"))], [("dies", Fake("verifier", die_after=2)), ("v", Fake("verifier"))], "verifier"),
        ("verifier slow", [("d", Fake("drafter"))], [("slow", Fake("verifier", delay_s=3)), ("v", Fake("verifier"))], "no answer"),
        ("verifier down", [("d", Fake("drafter"))], [("dead", None), ("v", Fake("verifier"))], "Cannot connect"),
    ],
)  # fmt: skip
def test_faults_finish_on_a_verifier_with_the_same_output(fault, drafters, verifiers, cause):
    got = run(
        routed(
            verifiers, drafters, {**BODY, "stream": True}, verify_timeout_s=1.0, open_timeout_s=1.0, draft_first_s=2.0
        )
    )
    assert got["status"] == 200
    assert got["ids"] == WANT, fault
    served = got["last"]["vericache"]
    assert served["path"] == "fallback" and cause in served["cause"], served
    assert served["verifier"] == verifiers[-1][1].url  # finished on the verifier that works


def test_only_a_slow_verifier_still_finishes_the_request():
    slow = Fake("verifier", delay_s=0.3)
    got = run(routed([("slow", slow)], [("d", Fake("drafter"))], BODY, verify_timeout_s=0.1, open_timeout_s=0.1))
    assert got["choices"][0]["token_ids"] == WANT and got["vericache"]["path"] == "fallback"


def test_sampling_and_other_options_are_passed_to_the_verifier_as_they_came():
    verifier, drafter = Fake("verifier"), Fake("drafter")
    body = {**BODY, "temperature": 0.7, "top_p": 0.9, "stream": True}
    got = run(routed([("v", verifier)], [("d", drafter)], body))
    assert got["status"] == 200 and got["ids"] == WANT  # the stand-in decodes greedily whatever it is asked
    assert verifier.bodies == [{**body, "model": "fake-verifier"}] and drafter.streams == 0 and not verifier.calls


def test_config_and_token_are_checked():
    with pytest.raises(ValueError, match="at least one verifier"):
        RouterConfig(verifiers=[])
    with pytest.raises(ValueError, match="ftp://x"):
        RouterConfig(verifiers=["ftp://x"])
    with pytest.raises(ValueError, match="k_min <= k_max"):
        RouterConfig(verifiers=["http://v:8000"], k_min=9, k_max=4)
    with pytest.raises(ValueError, match="verify_timeout_s"):
        RouterConfig(verifiers=["http://v:8000"], verify_timeout_s=0)
    with pytest.raises(ValueError, match="no router token"):
        router_token({})
    with pytest.raises(ValueError, match="at least 16") as e:
        router_token({"VERICACHE_ROUTER_TOKEN": "short"})
    assert "short" not in str(e.value)
    assert router_token({"VERICACHE_ROUTER_TOKEN": TOKEN}) == TOKEN.encode()
