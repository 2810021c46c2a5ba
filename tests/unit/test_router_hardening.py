"""`vericache router` as a public endpoint (issue 42), against stand-in upstream servers (no model, no vLLM):
fields are read as vLLM reads them (whatever the router cannot read exactly goes to a verifier as it came),
a client that goes away stops its decode, a bad input never takes a server out of rotation, the text ends as
vLLM's does on a partial UTF-8 character, and a cold verifier's first drafted call is not a fault.
The same malformed bodies against a real vLLM server: tests/integration/vllm/test_vllm_router.py."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

aiohttp = pytest.importorskip("aiohttp")

from vericache_connector.router.openai_api import Text, parse  # noqa: E402

from router_fakes import VOCAB, Fake, Stack, greedy, routed  # noqa: E402

PROMPT = [(i * 7919) % VOCAB for i in range(300)]
BODY = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "return_token_ids": True}


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize(
    "field, value",
    [
        ("ignore_eos", "false"),  # a string: vLLM's pydantic model reads it as False; bool() read it as True
        ("stream", "false"),
        ("max_tokens", 0),  # vLLM: 400 "max_tokens must be at least 1, got 0"
        ("max_tokens", -3),
        ("max_tokens", 2.5),
        ("top_p", 0),  # vLLM: 400 "top_p must be in (0, 1]"
        ("seed", "x"),
        ("seed", 1 << 70),
        ("n", 2),
        ("temperature", "0"),
        ("prompt", [1, 2, 99999999]),  # out of vocabulary
        ("prompt", [1, 2, -1]),
        ("prompt", "\ud800 lone surrogate"),
        ("stream_options", {"include_usage": True}),  # vLLM: stream options need stream=true
        ("logit_bias", {"5": 100}),  # a field a drafted request never carries
        ("cache_salt", "tenant-b"),  # issue 54 (2): a tenant's salt: never drafted from the shared store; the
        # verifier's connector leaves it alone too (scheduler.unkeyed_input)
    ],
)
def test_what_the_router_cannot_read_exactly_goes_to_a_verifier_as_it_came(field, value):
    verifier, drafter = Fake("verifier"), Fake("drafter")
    body = {**BODY, "stream": False, field: value}

    async def go():
        async with Stack([("v", verifier)], [("d", drafter)]) as st:
            got = await st.post(body)
            return got, [s.down_until for s in st.router.verifiers.servers + st.router.drafters.servers]

    got, down = run(go())
    assert verifier.bodies == [{**body, "model": "fake-verifier"}]  # passed on whole: vLLM reads it
    assert drafter.streams == 0 and not verifier.calls and down == [0.0, 0.0]


def test_a_lora_adapters_name_is_refused_never_drafted_on_base_model_kv():
    """Issue 54 (2): the router serves its own model name only; another (a LoRA adapter's) is vLLM's 404, and no
    drafter or verifier sees the request."""
    verifier, drafter = Fake("verifier"), Fake("drafter")

    async def go():
        async with Stack([("v", verifier)], [("d", drafter)]) as st:
            return await st.post({**BODY, "stream": False, "model": "adapter-a"})

    got = run(go())
    assert got["status"] == 404 and "adapter-a" in json.dumps(got)
    assert not verifier.bodies and not verifier.calls and drafter.streams == 0


def test_the_same_fields_read_exactly_are_drafted_for():
    verifier, drafter = Fake("verifier"), Fake("drafter")
    body = {**BODY, "ignore_eos": True, "stream": False, "seed": 7, "top_p": 1, "top_k": -1, "n": 1}
    got = run(routed([("v", verifier)], [("d", drafter)], body))
    assert got["vericache"]["path"] == "verified" and got["choices"][0]["token_ids"] == greedy(PROMPT, 40)
    assert parse("/v1/completions", {**BODY, "max_tokens": None}, {}, VOCAB).max_tokens is None  # vLLM's default
    assert parse("/v1/chat/completions", {"messages": "hi", "temperature": 0}, {}, VOCAB) is None
    chat = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_completion_tokens": 5}
    assert parse("/v1/chat/completions", chat, {}, VOCAB).tokenize == {"messages": chat["messages"]}


@pytest.mark.parametrize("stream", [False, True])
def test_a_refused_input_comes_back_as_the_verifier_answered_and_marks_no_server_down(stream):
    """A prompt the upstream servers refuse (as vLLM refuses an id it cannot embed: HTTP 400 on the verify
    route, an error event inside a 200 stream on /v1/completions) that the router's reading let through."""
    verifier, drafter = Fake("verifier", refused={PROMPT[5]}), Fake("drafter", refused={PROMPT[5]})

    async def go():
        async with Stack([("v", verifier)], [("d", drafter)]) as st:
            got = await st.post({**BODY, "stream": stream})
            return got, [s.down_until for s in st.router.verifiers.servers + st.router.drafters.servers]

    got, down = run(go())
    message = f"Token id {PROMPT[5]} is refused"
    if stream:
        assert got["status"] == 200 and got["last"]["error"]["message"] == message and got["ids"] == []
    else:
        assert got["status"] == 400 and got["error"]["message"] == message
    assert down == [0.0, 0.0]


def test_a_refused_chat_prompt_is_answered_as_the_verifiers_tokenizer_answered():
    verifier = Fake("verifier", refused={ord("!") % VOCAB})
    body = {"messages": [{"role": "user", "content": "hi!"}], "temperature": 0, "max_tokens": 5}

    async def go():
        async with Stack([("v", verifier)], [("d", Fake("drafter"))]) as st:
            return await st.post(body, "/v1/chat/completions"), st.router.verifiers.servers[0].down_until

    got, down = run(go())
    assert got["status"] == 400 and "is refused" in got["error"]["message"] and down == 0.0


def test_a_client_that_goes_away_stops_its_decode_within_a_verify_call(caplog):
    verifier, drafter = Fake("verifier", delay_s=0.1), Fake("drafter")
    body = {**BODY, "max_tokens": 400, "stream": False}

    async def go():
        async with Stack([("v", verifier)], [("d", drafter)], k_max=4) as st:
            async with aiohttp.ClientSession() as s:
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(1.0):
                        await s.post(st.url + "/v1/completions", json=body)
            await asyncio.sleep(0.5)  # the router notices within 0.25 s; the call in flight ends by 0.1 s
            at_stop = len(verifier.calls)
            await asyncio.sleep(1.0)
            return at_stop, len(verifier.calls)

    with caplog.at_level(logging.INFO, logger="vericache.router"):
        at_stop, later = run(go())
    assert 3 <= at_stop == later < 40, (at_stop, later)  # 400 tokens at <= 5 a call would be >= 80 calls
    ours = [r for r in caplog.records if r.name.startswith("vericache")]
    gone = [r for r in ours if "went away" in r.getMessage()]
    assert len(gone) == 1 and gone[0].exc_info is None
    assert not [r for r in ours if r.levelno >= logging.ERROR]


def test_a_streamed_client_that_goes_away_logs_one_line_and_no_traceback(caplog):
    verifier, drafter = Fake("verifier", delay_s=0.1), Fake("drafter")
    body = {**BODY, "max_tokens": 400, "stream": True}

    async def go():
        async with Stack([("v", verifier)], [("d", drafter)], k_max=4) as st:
            async with aiohttp.ClientSession() as s:
                async with s.post(st.url + "/v1/completions", json=body) as r:
                    await r.content.readline()
            await asyncio.sleep(1.0)
            at_stop = len(verifier.calls)
            await asyncio.sleep(0.5)
            return at_stop, len(verifier.calls)

    with caplog.at_level(logging.INFO):
        at_stop, later = run(go())
    assert at_stop == later < 40
    ours = [r for r in caplog.records if r.name.startswith("vericache")]  # (the stand-in drafter's log is not)
    assert len([r for r in ours if "went away" in r.getMessage()]) == 1
    assert not [r for r in ours if r.levelno >= logging.ERROR or r.exc_info]


class Utf8:
    """Token ids are bytes: a character can end in the middle of an answer."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", "replace")


class Accents:
    """A tokenizer where a token t % 5 == 0 opens a two-token character ("é" with the token after it): an
    answer can end inside it, which decodes to U+FFFD as a byte-level tokenizer's would."""

    def decode(self, ids, skip_special_tokens=True):
        out, i = [], 0
        while i < len(ids):
            lead = ids[i] % 5 == 0
            out.append(("é" if i + 1 < len(ids) else "\ufffd") if lead else "a")
            i += 2 if lead else 1
        return "".join(out)

    def __len__(self) -> int:
        return VOCAB


def test_an_answer_that_ends_inside_a_character_drops_it_as_vllm_does():
    text = Text(Utf8())
    euro = list("€".encode())  # 3 bytes
    assert text.add(list(b"ab")) == "ab" and text.add(euro[:1]) == "" and text.add(euro[1:]) == "€"
    assert text.add(euro[:2]) == "" and text.text == "ab€"  # the answer ends here: no U+FFFD
    # through the router: an answer cut by max_tokens inside a character, streamed and whole
    ids = greedy(PROMPT, 80)
    n = next(n for n in range(20, 80) if Accents().decode(ids[:n]).endswith("\ufffd"))
    want = Accents().decode(ids[:n])[:-1]

    async def go(stream):
        async with Stack([("v", Fake("verifier"))], [("d", Fake("drafter"))]) as st:
            st.router.tokenizer = Accents()
            return await st.post({**BODY, "max_tokens": n, "stream": stream})

    whole = run(go(False))
    assert whole["choices"][0]["text"] == want and "\ufffd" not in whole["choices"][0]["text"]
    assert run(go(True))["last"]["choices"][0]["text"] == ""  # nothing held back comes out at the end


def test_a_cold_verifiers_first_drafted_call_gets_the_opening_deadline():
    """A verifier's first forward over drafts can be slow (vLLM warms up): not a fault the first time."""
    verifier = Fake("verifier", first_drafts_s=1.5)
    got = run(routed([("v", verifier)], [("d", Fake("drafter"))], BODY, verify_timeout_s=1.0))
    assert got["vericache"]["path"] == "verified", got["vericache"]
    assert got["choices"][0]["token_ids"] == greedy(PROMPT, 40)


# ---- issue 39: many drafters, one verifier --------------------------------------------------------------------
def test_requests_that_share_a_prefix_go_to_the_same_drafter():
    drafters = [Fake("drafter") for _ in range(3)]
    # 12 prefixes: the ports (so the hash scores) are random; all 12 on one of 3 drafters has odds 3 / 3**12
    prompts = [[(i * 7 + j * 31) % VOCAB for i in range(300)] for j in range(12)]

    async def go():
        async with Stack([("v", Fake("verifier"))], [(f"d{i}", d) for i, d in enumerate(drafters)]) as st:
            for _ in range(2):
                for p in prompts:
                    got = await st.post({**BODY, "prompt": p + [5, 6], "max_tokens": 8})
                    assert got["vericache"]["path"] == "verified"

    run(go())
    served = {
        tuple(p): {i for i, d in enumerate(drafters) for b in d.bodies if b["prompt"][:300] == p} for p in prompts
    }
    assert all(len(s) == 1 for s in served.values()), served  # each prefix: one drafter, every time
    assert len(set().union(*served.values())) >= 2  # and the prefixes are spread over the drafters


def test_a_dead_drafter_is_skipped_without_a_failed_request():
    live = Fake("drafter")

    async def go():
        async with Stack([("v", Fake("verifier"))], [("dead", None), ("live", live)]) as st:
            return [await st.post({**BODY, "prompt": [(i * 13 + j) % VOCAB for i in range(300)], "max_tokens": 8})
                    for j in range(6)]  # fmt: skip

    answers = run(go())
    assert all(a["status"] == 200 for a in answers)
    for j, a in enumerate(answers):
        assert a["choices"][0]["token_ids"] == greedy([(i * 13 + j) % VOCAB for i in range(300)], 8)
    paths = [a["vericache"]["path"] for a in answers]
    assert paths.count("fallback") <= 1 and paths.count("verified") >= 5, paths  # found down once, then skipped


def test_a_saturated_verifier_hands_new_requests_to_a_drafter_alone():
    """A verifier whose verify calls take longer than verify_slow_s: the next request is served by a drafter
    alone, which computes its prompt itself (the connector off) under a cache salt of its own (none of its
    lossy blocks): the same exact output, no verify call."""
    slow, drafter = Fake("verifier", delay_s=1.2), Fake("drafter", wrong=lambda pos: pos % 3 == 0)

    async def go():
        async with Stack([("v", slow)], [("d", drafter)], verify_slow_s=1.0, k_min=4, k_max=8) as st:
            first = await st.post({**BODY, "max_tokens": 8})  # rejections: calls after its first over drafts
            calls = len(slow.calls)
            second = await st.post({**BODY, "max_tokens": 8})
            return first, calls, second

    first, calls, second = run(go())
    assert first["vericache"]["path"] == "verified" and first["vericache"]["drafted_calls"] >= 2
    assert second["vericache"]["path"] == "alone"
    assert len(slow.calls) == calls  # the second request made no verify call
    assert first["choices"][0]["token_ids"] == second["choices"][0]["token_ids"] == greedy(PROMPT, 8)
    alone = drafter.bodies[-1]
    assert alone["kv_transfer_params"] == {"vericache": "off"} and alone["cache_salt"] == "vericache-exact"


def test_a_requests_first_verify_call_is_not_a_queue():
    """A request's first verify call also brings its prompt's KV in on the verifier (a load or a prefill: seconds
    on a CPU); it says nothing of the verifier's queue. One slow first call must not hand the next requests to
    a drafter alone (the served run did: 2 of 8 requests at concurrency 1 recomputed their prompts)."""
    cold, drafter = Fake("verifier", first_drafts_s=1.5), Fake("drafter")

    async def go():
        async with Stack([("v", cold)], [("d", drafter)], verify_slow_s=1.0, k_min=4, k_max=8) as st:
            return [await st.post({**BODY, "max_tokens": 8}) for _ in range(2)]

    first, second = run(go())
    assert first["vericache"]["verify_calls"] >= 1 and first["vericache"]["verify_s"] >= 1.5  # it was slow
    assert [first["vericache"]["path"], second["vericache"]["path"]] == ["verified", "verified"]
    assert first["choices"][0]["token_ids"] == second["choices"][0]["token_ids"] == greedy(PROMPT, 8)


def test_vllms_benchmark_client_payload_is_drafted_and_answered_as_vllm_streams():
    """What `vllm bench serve` sends (logprobs null, repetition_penalty 1.0, stream_options include_usage):
    drafted for, and the usage comes in a last chunk of its own with no choices, as vLLM streams it."""
    body = {"model": "fake", "prompt": "def f(x): return x" * 20, "repetition_penalty": 1.0, "max_tokens": 8,
            "logprobs": None, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
            "temperature": 0}  # fmt: skip
    lines = []

    async def go():
        async with Stack([("v", Fake("verifier"))], [("d", Fake("drafter"))]) as st:
            async with aiohttp.ClientSession() as s, s.post(st.url + "/v1/completions", json=body) as r:
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        lines.append(json.loads(line[6:]))

    run(go())
    *chunks, usage = lines
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8
    assert chunks[-1]["vericache"]["path"] == "verified" and chunks[-1]["choices"][0]["finish_reason"] == "length"
