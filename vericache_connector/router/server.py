"""`vericache router`: the service users call, OpenAI-compatible, in front of a drafter pool and a verifier pool.

    VERICACHE_ROUTER_TOKEN_FILE=/run/secrets/router/token vericache router --host 0.0.0.0 --port 8000 \\
      --verifier http://vericache-verifier:8000 --drafter http://vericache-drafter:8000
    curl -s localhost:8000/v1/completions -d '{"model": "smollm2", "prompt": "def fib(n):", "max_tokens": 32,
                                               "temperature": 0, "stream": true}'

POST /v1/completions and /v1/chat/completions, streamed or not, answer like vLLM's own server. A greedy
request (temperature 0, no options that change greedy decoding) runs the draft / verify loop
(decode.py): drafts from a drafter-role vLLM server on the compressed copy, checked by a verifier
beside the store, each verified token streamed as soon as it is verified; its output is the verifier's
own greedy output; while a verifier has a free decode slot (--verifier-decode-slots) it decodes the
request by itself instead (path direct: the same output). Everything else (sampling, stop strings,
logprobs, n > 1, penalties, tools, ...) is passed to a verifier as it came and its answer passed back:
plain decoding there, exact by construction. Prompts are tokenized by the verifier (/tokenize: its
tokenizer and chat template); answers' text is decoded here with the same tokenizer. Every answer carries
"vericache": how it was served (path verified | direct | plain | alone | fallback, the fault that caused a
fallback, verify calls, drafts accepted per call).
GET /health answers once the router serves; GET /v1/models lists the served model; GET /metrics its Prometheus
series (observe.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
import uuid

from ..metrics import add_metrics_route
from .config import RouterConfig, config_from_args, router_token
from .decode import RoutedDecode, Wanted
from .observe import RouterMetrics
from .openai_api import CHAT, COMPLETIONS, NEUTRAL, Parsed, Reply, Text, error_body, parse, sse
from .slots import DirectSlots
from .upstream import ClientError, Pool, UpstreamError, Upstreams, affinity_key

logger = logging.getLogger("vericache.router")


class Router:
    def __init__(self, cfg: RouterConfig, token: bytes | None):
        self.cfg, self.token = cfg, token
        self.drafters = Pool.of(cfg.drafters, "drafter", cfg.down_s)
        self.verifiers = Pool.of(cfg.verifiers, "verifier", cfg.down_s)
        self.up: Upstreams | None = None
        self.tokenizer, self.eos, self.defaults = None, frozenset(), {}
        self.name = cfg.served_model_name
        self._ready = asyncio.Lock()
        self.slots = DirectSlots(cfg.verifier_decode_slots, cfg.max_verifier_decode_slots)  # path "direct"
        self.metrics = RouterMetrics(self.verifiers, self.slots)

    async def start(self) -> None:
        self.up = Upstreams(self.token, on_auth_failure=self.metrics.auth_failures.inc)

    async def close(self) -> None:
        if self.up is not None:
            await self.up.close()

    async def ready(self) -> None:
        """The model name, tokenizer and EOS ids, from the first verifier that answers (once)."""
        async with self._ready:
            if self.tokenizer is not None:
                return
            last = None
            for server in self.verifiers.servers:
                try:
                    await self.up.describe(server)
                    break
                except UpstreamError as e:
                    last = e
                    self.verifiers.fault(server)
            else:
                raise last
            self.name = self.name or server.model
            path = self.cfg.tokenizer or server.root
            self.tokenizer, self.eos, self.defaults = await asyncio.to_thread(load_tokenizer, path)

    def saturated(self) -> bool:
        """Every verifier that is up has a long queue (Server.saturated): verification beside the store is the
        bottleneck, and a drafter alone serves the next request faster than waiting for it would."""
        now, cfg = time.monotonic(), self.cfg
        up = [s for s in self.verifiers.servers if s.down_until <= now] or self.verifiers.servers
        return all(s.saturated(cfg.max_verify_inflight, cfg.verify_slow_s) for s in up)

    # ---- a request --------------------------------------------------------------------------------------
    def parse(self, path: str, body: dict) -> Parsed | None:
        """The request to draft for, or None: plain decoding on a verifier (openai_api.parse)."""
        if not self.drafters.servers:
            return None
        return parse(path, body, self.defaults, len(self.tokenizer))

    async def prompt_ids(self, req: Parsed) -> list[int]:
        """The prompt as the verifier tokenizes it."""
        if req.prompt_ids is not None:
            return req.prompt_ids
        return await self.up.tokenize(self.verifiers.pick(), req.tokenize, 60.0)

    def wanted(self, req: Parsed, n_prompt: int) -> Wanted | None:
        """What to decode; None past the context length (the verifier answers that with vLLM's own 400)."""
        limit = self.verifiers.servers[0].max_model_len
        max_tokens = req.max_tokens
        if max_tokens is None:
            max_tokens = limit - n_prompt if req.chat and limit else 16
        if max_tokens < 1 or (limit and n_prompt + max_tokens > limit):
            return None
        return Wanted(max_tokens=max_tokens, ignore_eos=req.ignore_eos, eos=self.eos)


def load_tokenizer(path: str | None):
    """(tokenizer, EOS ids vLLM stops on, the generation config's sampling defaults) of the served model."""
    if not path:
        raise ValueError("no tokenizer: pass --tokenizer (the verifier's /v1/models names no model path)")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    defaults = {}
    gen = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen):
        with open(gen) as f:
            cfg = json.load(f)
        ids = cfg.get("eos_token_id")
        eos |= {ids} if isinstance(ids, int) else set(ids or ())
        defaults = {k: cfg[k] for k in NEUTRAL if k in cfg}
    return tok, frozenset(eos), defaults


def make_app(router: Router):
    """The routes: each handler decides where a request goes; Reply (openai_api.py) shapes the answer."""
    from aiohttp import web

    def failed(message: str, status: int, kind: str):
        return web.json_response(error_body(message, status, kind), status=status)

    async def health(_):
        return web.Response(text="ok")

    async def models(_):
        try:
            await router.ready()
        except (UpstreamError, ValueError, OSError) as e:
            return failed(str(e), 503, "ServiceUnavailable")
        card = {"id": router.name, "object": "model", "created": int(time.time()), "owned_by": "vericache"}
        return web.json_response({"object": "list", "data": [card]})

    async def complete(request):
        """Answer, then count how (observe.py)."""
        t0, served = time.perf_counter(), {}
        resp = await answer_or_pass(request, served)
        router.metrics.answered(
            request.path, served.get("path", "failed"), time.perf_counter() - t0, served.get("stats")
        )
        return resp

    async def answer_or_pass(request, served: dict):
        path = request.path
        try:
            body = json.loads(await request.read())
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except ValueError as e:
            served["path"] = "refused"
            return failed(f"bad body: {e}", 400, "BadRequestError")
        try:
            await router.ready()
        except (UpstreamError, ValueError, OSError) as e:
            return failed(str(e), 503, "ServiceUnavailable")
        model = body.get("model")
        if isinstance(model, str) and model != router.name:
            served["path"] = "refused"
            return failed(f"The model `{model}` does not exist.", 404, "NotFoundError")
        req = router.parse(path, body)
        if req is None:
            served["path"] = "passed"
            return await proxy(request, path, body)
        try:
            ids = await router.prompt_ids(req)
        except ClientError as e:  # the verifier refused the prompt: its answer, as it gave it
            served["path"] = "refused"
            return web.json_response(e.answer, status=e.status)
        except UpstreamError as e:
            return failed(str(e), 502, "BadGateway")
        want = router.wanted(req, len(ids))
        if want is None:
            served["path"] = "passed"
            return await proxy(request, path, body)
        return await answer(request, req, ids, want, served)

    async def answer(request, req: Parsed, ids: list[int], want: Wanted, served_as: dict):
        """Run the loop; stream each verified chunk, or answer once at the end. A client that goes away
        stops the loop (within one verify call) with one log line."""
        rid = f"{'chatcmpl' if req.chat else 'cmpl'}-{uuid.uuid4().hex}"
        reply, t0 = Reply(rid, int(time.time()), router.name, req), time.perf_counter()
        decode = RoutedDecode(
            router.cfg,
            router.up,
            router.drafters,
            router.verifiers,
            ids,
            want,
            alone=router.saturated(),
            direct_slots=router.slots.limit,
        )
        out: asyncio.Queue = asyncio.Queue()
        task = asyncio.create_task(decode.run(out))
        text, resp = Text(router.tokenizer), None
        served_as["stats"] = decode.stats
        try:
            if req.stream:
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
                await resp.prepare(request)
                await write(resp, sse(reply.chunk("", [], None, first=True)) if req.chat else b"")
            while (new := await watched(request, out.get())) is not None:
                delta = text.add(new)
                if req.stream:
                    await write(resp, sse(reply.chunk(delta, new, None)))
            await task  # raises when no verifier could finish the request
        except ClientGone:
            served_as["path"] = "gone"
            logger.info("router: %s: the client went away after %d tokens; stopped", rid, len(decode.emitted))
            return resp or web.Response(status=499)
        except ClientError as e:  # a verifier refused the request (vLLM's 4xx): its answer, as it gave it
            served_as["path"] = "refused"
            if resp is None:
                return web.json_response(e.answer, status=e.status)
            await resp.write(sse(e.answer) + b"data: [DONE]\n\n")
            return resp
        except UpstreamError as e:
            logger.warning("router: %s failed: %s", rid, e)
            if resp is None:
                return failed(str(e), 502, "BadGateway")
            await resp.write(sse(error_body(str(e), 502, "BadGateway")) + b"data: [DONE]\n\n")
            return resp
        finally:
            if not task.done():
                task.cancel()
        tokens, st = decode.emitted, decode.stats
        served_as["path"] = st.path
        at_eos = bool(tokens) and tokens[-1] in want.eos and not want.ignore_eos
        finish = "length" if len(tokens) >= want.max_tokens and not at_eos else "stop"
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(tokens), "total_tokens": len(ids) + len(tokens)}
        total_s = time.perf_counter() - t0
        router.slots.observe(st.path, len(tokens), total_s)  # sizes the direct slots (router/slots.py)
        served = {**vars(st), "total_s": round(total_s, 4), "direct_slots": router.slots.limit}
        logger.info(
            "router: %s: %d prompt + %d new tokens, %s%s, %d verify calls (%.2fs), accepted %s, %d drafted in %d "
            "streams, first token %.2fs, %.2fs",
            rid, len(ids), len(tokens), st.path, f" ({st.cause})" if st.cause else "", st.verify_calls, st.verify_s,
            st.accepted, st.drafted, st.streams, st.first_token_s or -1, served["total_s"],
        )  # fmt: skip
        if req.stream:
            last = reply.chunk("", [], finish)
            last["vericache"] = served
            tail = sse(last)
            if req.include_usage:  # as vLLM: a last chunk of its own, no choices
                tail += sse({**reply.chunk("", [], None), "choices": [], "usage": usage})
            await write(resp, tail + b"data: [DONE]\n\n")
            return resp
        return web.json_response({**reply.whole(text.text, tokens, finish, usage), "vericache": served})

    async def proxy(request, path, body):
        """Plain decoding on a verifier: the body as it came (the verifier's model name), its answer back."""
        import aiohttp

        tried: set[str] = set()
        key = affinity_key(body.get("prompt") if "prompt" in body else json.dumps(body.get("messages")))
        while (server := router.verifiers.pick_for(key, avoid=tried)) is not None:  # same prefix, same server
            tried.add(server.url)
            resp = None

            async def relay():
                nonlocal resp
                await router.up.describe(server)
                # the verifier's model name, unless the client's is not a name at all (vLLM refuses that)
                sent = {**body, "model": server.model} if isinstance(body.get("model"), (str, type(None))) else body
                async with router.up.session.post(
                    server.url + path, data=json.dumps(sent), headers=router.up.headers
                ) as r:
                    if r.status in (401, 403):
                        router.metrics.auth_failures.inc()
                    resp = web.StreamResponse(status=r.status, headers={"Content-Type": r.content_type})
                    await resp.prepare(request)
                    async for data in r.content.iter_any():
                        await write(resp, data)
                    return resp

            try:
                return await watched(request, relay())
            except ClientGone:
                logger.info("router: the client of a passed-on request went away; stopped")
                return resp
            except (UpstreamError, aiohttp.ClientError, OSError) as e:
                router.verifiers.fault(server)
                logger.warning(
                    "router: verifier %s failed a passed-on request (%s: %s)", server.url, type(e).__name__, e
                )
                if resp is not None:  # part of the answer is out: it cannot start again elsewhere
                    return resp
        return failed("every verifier failed", 502, "BadGateway")

    app = web.Application(client_max_size=router.cfg.max_body_bytes)
    add_metrics_route(app, router.metrics.m)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post(COMPLETIONS, complete)
    app.router.add_post(CHAT, complete)
    app.on_startup.append(lambda _: router.start())
    app.on_cleanup.append(lambda _: router.close())
    return app


class ClientGone(Exception):
    pass


async def watched(request, aw, every_s: float = 0.25):
    """Await `aw`; once the client's connection is closed, cancel it and raise ClientGone (aiohttp does not
    cancel a handler whose client went away, so a long decode would run on for nobody)."""
    task = asyncio.ensure_future(aw)
    try:
        while True:
            transport = request.transport
            if transport is None or transport.is_closing():
                raise ClientGone
            done, _ = await asyncio.wait({task}, timeout=every_s)
            if done:
                return task.result()
    finally:
        task.cancel()  # a no-op once it returned


async def write(resp, data: bytes) -> None:
    """Write to the client; ClientGone when it went away."""
    try:
        await resp.write(data)
    except ConnectionResetError:
        raise ClientGone from None


async def warm_up(router: Router, every_s: float = 2.0) -> None:
    """The model name and the tokenizer before the first request needs them (verifiers may start later)."""
    while True:
        try:
            await router.ready()
            logger.info("router: serving %s (tokenizer loaded)", router.name)
            return
        except (UpstreamError, ValueError, OSError) as e:
            logger.info("router: verifiers not ready yet (%s)", e)
            await asyncio.sleep(every_s)


def main(args) -> int:
    """The CLI entry (cli.py `router`): serve until SIGTERM/SIGINT."""
    from aiohttp import web

    logging.getLogger("vericache").setLevel(logging.INFO)
    cfg = config_from_args(args)
    token = router_token() if cfg.drafters else None  # drafter-role servers answer only with it
    if token is None:
        try:
            token = router_token()
        except ValueError:
            pass  # no drafters and no token: the verifiers need none
    router = Router(cfg, token)

    async def serve() -> None:
        runner = web.AppRunner(make_app(router), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        port = runner.addresses[0][1]
        print(
            f"vericache router: serving requests on http://{args.host}:{port} (verifiers {', '.join(cfg.verifiers)}; "
            f"drafters {', '.join(cfg.drafters) or 'none'}; verify api {cfg.verify_api}; "
            f"verifier decode slots {cfg.verifier_decode_slots}, up to {cfg.max_verifier_decode_slots})",
            flush=True,
        )
        warm = asyncio.create_task(warm_up(router))
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
        warm.cancel()
        await runner.cleanup()

    asyncio.run(serve())
    return 0
