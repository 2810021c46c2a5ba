"""Stand-in upstream vLLM servers for `vericache router` on 127.0.0.1 (no model, no vLLM), and the router in
front of them: tests/unit/test_router_loop.py (the loop's exactness) and test_router_hardening.py (what a
hostile or unlucky client does).

The stand-ins speak the vLLM API the router uses. The "model" is a fixed function: the verifier's greedy
token after a sequence is truth(seq); the drafter drafts truth(seq) too, except at positions where
`wrong(pos)` holds (a rejected draft there). A drafter can also stop mid-stream or never answer, a
verifier can fail or be slow, and either can refuse a prompt holding a token of `refused` as vLLM refuses
a bad input (HTTP 400, or an error event inside a 200 stream).
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from vericache_connector.router.config import RouterConfig
from vericache_connector.router.server import Router, make_app

from net import free_port

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


STREAM_TRUE = (True, 1, "true", "True", "1", "yes", "on")  # what vLLM's pydantic model reads as true


class Fake:
    """A stand-in vLLM server: role 'verifier' (verify route, plain streaming, /tokenize) or 'drafter'."""

    def __init__(self, role: str, wrong=lambda pos: False, cut_after: int | None = None, delay_s: float = 0.0,
                 die_after: int | None = None, refused: frozenset = frozenset(), first_drafts_s: float = 0.0,
                 deny: bool = False):  # fmt: skip
        self.role, self.wrong, self.cut_after, self.delay_s = role, wrong, cut_after, delay_s
        self.die_after = die_after  # verify calls answered before it dies (connections closed)
        self.refused = refused  # token ids (and chat texts) it refuses as vLLM refuses a bad input
        self.first_drafts_s = first_drafts_s  # its first verify call with drafts takes this long (a cold start)
        self.deny = deny  # every POST answered 401 (it does not take the router's token)
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

    def refusal(self, ids: list[int]) -> dict | None:
        bad = [t for t in ids if t in self.refused]
        return None if not bad else {"error": {"message": f"Token id {bad[0]} is refused", "type": "BadRequestError",
                                               "param": None, "code": 400}}  # fmt: skip

    async def tokenize(self, request):
        body = await request.json()
        text = body.get("prompt") or json.dumps(body.get("messages"))
        ids = [ord(c) % VOCAB for c in text]
        if (no := self.refusal(ids)) is not None:
            return web.json_response(no, status=400)
        return web.json_response({"tokens": ids})

    async def verify(self, request):
        body = await request.json()
        await asyncio.sleep(self.delay_s)
        seq, drafts = body["prompt"], body["drafts"]
        if (no := self.refusal(seq + drafts)) is not None:
            return web.json_response(no, status=400)
        if drafts and not any(d for _, d in self.calls):
            await asyncio.sleep(self.first_drafts_s)
        if self.die_after is not None and len(self.calls) >= self.die_after:
            request.transport.close()
            return web.Response()
        self.calls.append((len(seq), len(drafts)))
        best = [truth(seq + drafts[:j]) for j in range(len(drafts) + 1)]
        return web.json_response({"best": best, "cached": 0})

    async def complete(self, request):
        self.auth.append(request.headers.get("Authorization"))
        if self.deny:
            return web.json_response({"error": {"message": "Unauthorized", "code": 401}}, status=401)
        body = await request.json()
        self.bodies.append(body)
        if body.get("prompt_logprobs"):  # a verify call through the plain OpenAI API (vLLM's answer shape)
            seq = body["prompt"]
            self.calls.append((None, body["max_tokens"]))
            rows = [None] + [{str(truth(seq[:i])): {"logprob": -0.1, "rank": 1}} for i in range(1, len(seq))]
            for i in range(1, len(seq)):
                rows[i].setdefault(str(seq[i]), {"logprob": -3.0, "rank": 5})
            return web.json_response({"choices": [{"prompt_logprobs": rows, "token_ids": [truth(seq)]}]})
        if body.get("stream") not in STREAM_TRUE:  # a passed-on request answered whole
            seq = body.get("prompt")
            try:
                out = greedy(seq, body["max_tokens"])
            except (TypeError, KeyError, ValueError):  # what vLLM would refuse, roughly
                return web.json_response({"error": {"message": "bad request", "code": 400}}, status=400)
            if (no := self.refusal(seq)) is not None:
                return web.json_response(no, status=400)
            return web.json_response({"choices": [{"text": "", "token_ids": out, "finish_reason": "length"}]})
        self.streams += 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if (no := self.refusal(body["prompt"])) is not None:  # vLLM: an error event inside a 200 stream
            await resp.write(b"data: " + json.dumps(no).encode() + b"\n\ndata: [DONE]\n\n")
            return resp
        seq = list(body["prompt"])
        for i in range(body["max_tokens"]):
            await asyncio.sleep(0.002)
            if self.cut_after is not None and i >= self.cut_after:
                request.transport.close()  # the server dies mid-stream
                return resp
            t = truth(seq)
            lossy = body.get("kv_transfer_params") != {"vericache": "off"}  # off: it computes the prompt itself
            if self.role == "drafter" and lossy and self.wrong(len(seq)):
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


class Stack:
    """The stand-ins and the router in front of them: `async with Stack(verifiers, drafters) as st`, then
    st.post(body) or any client on st.url; st.router is the Router (its pools: which server is marked down).
    A stand-in given as None is a server that is down (a port nothing listens on). Greedy requests are drafted
    and verified unless a test gives the verifiers decode slots of their own (verifier_decode_slots=N: the
    router's path "direct", tests/unit/test_router_direct.py; a fixed count unless max_verifier_decode_slots is
    given too)."""

    def __init__(self, verifiers, drafters, **cfg):
        self.verifiers, self.drafters, self.cfg = verifiers, drafters, {"verifier_decode_slots": 0, **cfg}
        self.cfg.setdefault("max_verifier_decode_slots", self.cfg["verifier_decode_slots"])  # fixed unless given
        self.runners: list = []

    async def __aenter__(self) -> "Stack":
        urls = {}
        for name, fake in [*self.verifiers, *self.drafters]:
            if fake is None:
                urls[name] = f"http://127.0.0.1:{free_port()}"
                continue
            runner, urls[name] = await serve(fake.app())
            fake.url = urls[name]
            self.runners.append(runner)
        config = RouterConfig(
            verifiers=[urls[n] for n, _ in self.verifiers],
            drafters=[urls[n] for n, _ in self.drafters],
            tokenizer="unused",
            **self.cfg,
        )
        self.router = Router(config, TOKEN.encode())
        self.router.tokenizer, self.router.eos, self.router.name = Detok(), frozenset({EOS}), "fake"
        runner, self.url = await serve(make_app(self.router))
        self.runners.append(runner)
        return self

    async def __aexit__(self, *exc) -> None:
        for r in self.runners:
            await r.cleanup()

    async def post(self, body: dict, path: str = "/v1/completions") -> dict:
        """One request; the answer (streamed: the chunks' token ids and texts joined, and the last chunk)."""
        async with aiohttp.ClientSession() as s:
            async with s.post(self.url + path, json=body) as r:
                if body.get("stream") is not True:
                    return {"status": r.status, **(await r.json(content_type=None))}
                ids, text, last = [], "", None
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        last = json.loads(line[6:])
                        for c in last.get("choices", [])[:1]:
                            ids += c.get("token_ids", [])
                            text += c.get("text", c.get("delta", {}).get("content", ""))
                return {"status": r.status, "ids": ids, "text": text, "last": last}


async def routed(verifiers, drafters, body: dict, path="/v1/completions", **cfg) -> dict:
    """Start the stand-ins and the router, send one request, return the answer (Stack.post)."""
    async with Stack(verifiers, drafters, **cfg) as st:
        return await st.post(body, path)


class Detok:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))

    def __len__(self) -> int:  # the vocabulary
        return VOCAB
