"""`vericache router` against stand-in upstream servers on 127.0.0.1 (no model, no vLLM): the draft / verify
loop must emit exactly the verifier's greedy tokens, whatever the drafter drafts and whatever faults occur.

The stand-ins speak the vLLM API the router uses. The "model" is a fixed function: the verifier's greedy
token after a sequence is truth(seq); the drafter drafts truth(seq) too, except at positions where
`wrong(pos)` holds (a rejected draft there). A drafter can also stop mid-stream or never answer, and a
verifier can fail or be slow: the answer must still be truth's continuation, token for token.
"""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from vericache_connector.router.config import RouterConfig, router_token  # noqa: E402
from vericache_connector.router.server import Router, make_app  # noqa: E402

VOCAB, EOS = 1000, 7
TOKEN = "t" * 24


def truth(seq: list[int]) -> int:
    """The verifier's greedy next token (never EOS unless the sequence says so)."""
    t = (sum(seq) * 31 + len(seq) * 17) % VOCAB
    return t if t != EOS else EOS + 1


def greedy(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(truth(seq))
    return seq[len(prompt) :]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Fake:
    """A stand-in vLLM server: role 'verifier' (verify route, plain streaming, /tokenize) or 'drafter'."""

    def __init__(self, role: str, wrong=lambda pos: False, cut_after: int | None = None, delay_s: float = 0.0,
                 die_after: int | None = None):  # fmt: skip
        self.role, self.wrong, self.cut_after, self.delay_s = role, wrong, cut_after, delay_s
        self.die_after = die_after  # verify calls answered before it dies (connections closed)
        self.calls: list[tuple[int, int]] = []  # verify calls: (len(prompt), drafts)
        self.streams = 0
        self.bodies: list[dict] = []
        self.auth: list[str | None] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/vericache/verify", self.verify)
        app.router.add_post("/tokenize", self.tokenize)
        return app

    async def models(self, _):
        return web.json_response({"data": [{"id": f"fake-{self.role}", "root": None, "max_model_len": 4096}]})

    async def tokenize(self, request):
        body = await request.json()
        text = body.get("prompt") or json.dumps(body.get("messages"))
        return web.json_response({"tokens": [ord(c) % VOCAB for c in text]})

    async def verify(self, request):
        body = await request.json()
        await asyncio.sleep(self.delay_s)
        seq, drafts = body["prompt"], body["drafts"]
        if self.die_after is not None and len(self.calls) >= self.die_after:
            request.transport.close()
            return web.Response()
        self.calls.append((len(seq), len(drafts)))
        best = [truth(seq + drafts[:j]) for j in range(len(drafts) + 1)]
        return web.json_response({"best": best, "cached": 0})

    async def complete(self, request):
        self.auth.append(request.headers.get("Authorization"))
        body = await request.json()
        self.bodies.append(body)
        if body.get("prompt_logprobs"):  # a verify call through the plain OpenAI API (vLLM's answer shape)
            seq = body["prompt"]
            self.calls.append((None, body["max_tokens"]))
            rows = [None] + [{str(truth(seq[:i])): {"logprob": -0.1, "rank": 1}} for i in range(1, len(seq))]
            for i in range(1, len(seq)):
                rows[i].setdefault(str(seq[i]), {"logprob": -3.0, "rank": 5})
            return web.json_response({"choices": [{"prompt_logprobs": rows, "token_ids": [truth(seq)]}]})
        assert body["stream"]
        self.streams += 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        seq = list(body["prompt"])
        for i in range(body["max_tokens"]):
            await asyncio.sleep(0.002)
            if self.cut_after is not None and i >= self.cut_after:
                request.transport.close()  # the server dies mid-stream
                return resp
            t = truth(seq)
            if self.role == "drafter" and self.wrong(len(seq)):
                t = (t + 1) % VOCAB
            seq.append(t)
            await resp.write(
                b"data: " + json.dumps({"choices": [{"token_ids": [t], "finish_reason": None}]}).encode() + b"\n\n"
            )
        await resp.write(b"data: [DONE]\n\n")
        return resp


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def routed(verifiers, drafters, body: dict, path="/v1/completions", **cfg) -> dict:
    """Start the fakes and the router, send one request, return the answer (streamed: the chunks joined)."""
    runners, urls = [], {}
    for name, fake in [*verifiers, *drafters]:
        if fake is None:  # a server that is down: a port nothing listens on
            urls[name] = f"http://127.0.0.1:{free_port()}"
            continue
        runner, urls[name] = await serve(fake.app())
        fake.url = urls[name]
        runners.append(runner)
    config = RouterConfig(
        verifiers=[urls[n] for n, _ in verifiers],
        drafters=[urls[n] for n, _ in drafters],
        tokenizer="unused",
        **cfg,
    )
    router = Router(config, TOKEN.encode())
    router.tokenizer, router.eos, router.name = Detok(), frozenset({EOS}), "fake"
    runner, url = await serve(make_app(router))
    runners.append(runner)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(url + path, json=body) as r:
                if not body.get("stream"):
                    return {"status": r.status, **(await r.json())}
                ids, last = [], None
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        last = json.loads(line[6:])
                        ids += last["choices"][0].get("token_ids", []) if "choices" in last else []
                return {"status": r.status, "ids": ids, "last": last}
    finally:
        for r in runners:
            await r.cleanup()


class Detok:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


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
        router = Router(RouterConfig(verifiers=[uv], drafters=[ud], tokenizer="x"), TOKEN.encode())
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
