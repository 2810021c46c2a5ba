"""`vericache router`: the service users call, OpenAI-compatible, in front of a drafter pool and a verifier pool.

    VERICACHE_ROUTER_TOKEN_FILE=/run/secrets/router/token vericache router --host 0.0.0.0 --port 8000 \\
      --verifier http://vericache-verifier:8000 --drafter http://vericache-drafter:8000
    curl -s localhost:8000/v1/completions -d '{"model": "smollm2", "prompt": "def fib(n):", "max_tokens": 32,
                                               "temperature": 0, "stream": true}'

POST /v1/completions and /v1/chat/completions, streamed or not, answer like vLLM's own server. A greedy
request (temperature 0, no options that change greedy decoding) runs the draft / verify loop
(router_decode.py): drafts from a drafter-role vLLM server on the compressed copy, checked by a verifier
beside the store, each verified token streamed as soon as it is verified; its output is the verifier's
own greedy output. Everything else (sampling, stop strings, logprobs, n > 1, penalties, tools, ...) is
passed to a verifier as it came and its answer passed back: plain decoding there, exact by construction.
Prompts are tokenized by the verifier (/tokenize: its tokenizer and chat template); answers' text is
decoded here with the same tokenizer. Every answer carries "vericache": how it was served (path
verified | plain | fallback, the fault that caused a fallback, verify calls, drafts accepted per call).
GET /health answers once the router serves; GET /v1/models lists the served model.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
import uuid

from .config import RouterConfig, config_from_args, router_token
from .decode import RoutedDecode, Wanted
from .upstream import Pool, UpstreamError, Upstreams

logger = logging.getLogger("vericache.router")
GREEDY_EPS = 1e-5  # vLLM's: a temperature below it is greedy
SHARED = {"model", "max_tokens", "temperature", "stream", "stream_options", "ignore_eos", "return_token_ids", "user"}
SHARED |= {"n", "seed", "top_p", "top_k", "min_p", "request_id", "repetition_penalty", "frequency_penalty"}
SHARED |= {"presence_penalty"}
SPECULATED = {  # the fields a drafted request may carry (anything else: passed to a verifier as it came)
    "/v1/completions": SHARED | {"prompt", "add_special_tokens"},
    "/v1/chat/completions": SHARED
    | {"messages", "max_completion_tokens", "add_generation_prompt", "continue_final_message", "chat_template_kwargs"},
}
NEUTRAL = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}


class Router:
    def __init__(self, cfg: RouterConfig, token: bytes | None):
        self.cfg, self.token = cfg, token
        self.drafters = Pool.of(cfg.drafters, "drafter", cfg.down_s)
        self.verifiers = Pool.of(cfg.verifiers, "verifier", cfg.down_s)
        self.up: Upstreams | None = None
        self.tokenizer, self.eos, self.defaults = None, frozenset(), {}
        self.name = cfg.served_model_name
        self._ready = asyncio.Lock()

    async def start(self) -> None:
        self.up = Upstreams(self.token)

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

    # ---- a request --------------------------------------------------------------------------------------
    def speculable(self, path: str, body: dict) -> bool:
        if not self.drafters.servers or set(body) - SPECULATED[path]:
            return False
        t = body.get("temperature")
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 <= t < GREEDY_EPS:
            return False  # absent: the verifier's default (1.0 unless its generation config says otherwise)
        if body.get("n", 1) != 1 or not isinstance(body.get("stream_options") or {}, dict):
            return False
        return all(body.get(k, self.defaults.get(k, v)) == v for k, v in NEUTRAL.items())

    async def prompt_ids(self, path: str, body: dict) -> list[int] | None:
        """The prompt as the verifier tokenizes it; None for what is passed on (a batch, embeddings)."""
        if path == "/v1/chat/completions":
            keys = ("messages", "add_generation_prompt", "continue_final_message", "chat_template_kwargs")
            return await self.up.tokenize(self.verifiers.pick(), {k: body[k] for k in keys if k in body}, 60.0)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt):
            return prompt
        if isinstance(prompt, str) and prompt:
            tk = {"prompt": prompt, "add_special_tokens": body.get("add_special_tokens", True)}
            return await self.up.tokenize(self.verifiers.pick(), tk, 60.0)
        return None

    def wanted(self, path: str, body: dict, n_prompt: int) -> Wanted:
        limit = self.verifiers.servers[0].max_model_len
        default = 16 if path == "/v1/completions" else (limit - n_prompt if limit else None)
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens")) or default
        if type(max_tokens) is not int or max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        if limit and n_prompt + max_tokens > limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} to generate)"
            )
        return Wanted(max_tokens=max_tokens, ignore_eos=bool(body.get("ignore_eos", False)), eos=self.eos)


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


class Text:
    """Incremental detokenization: the text each new chunk of token ids adds (held back while it ends in
    an incomplete UTF-8 sequence)."""

    def __init__(self, tokenizer):
        self.tok, self.ids, self.text = tokenizer, [], ""

    def add(self, ids: list[int], final: bool = False) -> str:
        self.ids += ids
        new = self.tok.decode(self.ids, skip_special_tokens=True)
        if (new.endswith("\ufffd") and not final) or not new.startswith(self.text):
            return ""
        delta, self.text = new[len(self.text) :], new
        return delta


def error_body(message: str, status: int, kind: str = "BadRequestError") -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def make_app(router: Router):
    from aiohttp import web

    async def health(_):
        return web.Response(text="ok")

    async def models(_):
        try:
            await router.ready()
        except (UpstreamError, ValueError, OSError) as e:
            return web.json_response(error_body(str(e), 503, "ServiceUnavailable"), status=503)
        card = {"id": router.name, "object": "model", "created": int(time.time()), "owned_by": "vericache"}
        return web.json_response({"object": "list", "data": [card]})

    async def complete(request):
        path = request.path
        try:
            body = json.loads(await request.read())
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except ValueError as e:
            return web.json_response(error_body(f"bad body: {e}", 400), status=400)
        try:
            await router.ready()
        except (UpstreamError, ValueError, OSError) as e:
            return web.json_response(error_body(str(e), 503, "ServiceUnavailable"), status=503)
        if body.get("model") not in (None, router.name):
            msg = f"The model `{body.get('model')}` does not exist."
            return web.json_response(error_body(msg, 404, "NotFoundError"), status=404)
        if not router.speculable(path, body):
            return await proxy(request, path, body)
        try:
            ids = await router.prompt_ids(path, body)
            if ids is None:
                return await proxy(request, path, body)
            want = router.wanted(path, body, len(ids))
        except ValueError as e:
            return web.json_response(error_body(str(e), 400), status=400)
        except UpstreamError as e:
            return web.json_response(error_body(str(e), 502, "BadGateway"), status=502)
        return await answer(request, path, body, ids, want)

    async def answer(request, path, body, ids, want):
        """Run the loop; stream each verified chunk, or answer once at the end."""
        chat = path == "/v1/chat/completions"
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created, t0 = int(time.time()), time.perf_counter()
        decode = RoutedDecode(router.cfg, router.up, router.drafters, router.verifiers, ids, want)
        out: asyncio.Queue = asyncio.Queue()
        task = asyncio.create_task(decode.run(out))
        text, stream = Text(router.tokenizer), bool(body.get("stream"))
        with_ids = bool(body.get("return_token_ids"))

        def chunk(delta: str, new: list[int], finish: str | None, first: bool = False) -> dict:
            if chat:
                d = ({"role": "assistant"} if first else {}) | ({"content": delta} if delta or first else {})
                c = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
            else:
                c = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish, "stop_reason": None}
            if with_ids:
                c["token_ids"] = new
            obj = "chat.completion.chunk" if chat else "text_completion"
            return {"id": rid, "object": obj, "created": created, "model": router.name, "choices": [c]}

        resp = None
        try:
            if stream:
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
                await resp.prepare(request)
                await resp.write(sse(chunk("", [], None, first=True)) if chat else b"")
            while (new := await out.get()) is not None:
                delta = text.add(new)
                if stream:
                    await resp.write(sse(chunk(delta, new, None)))
            await task  # raises when no verifier could finish the request
        except UpstreamError as e:
            logger.warning("router: %s failed: %s", rid, e)
            if resp is None:
                return web.json_response(error_body(str(e), 502, "BadGateway"), status=502)
            await resp.write(sse(error_body(str(e), 502, "BadGateway")) + b"data: [DONE]\n\n")
            return resp
        finally:
            if not task.done():
                task.cancel()
        tail = text.add([], final=True)
        tokens, st = decode.emitted, decode.stats
        at_eos = bool(tokens) and tokens[-1] in want.eos and not want.ignore_eos
        finish = "length" if len(tokens) >= want.max_tokens and not at_eos else "stop"
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(tokens), "total_tokens": len(ids) + len(tokens)}
        served = {**vars(st), "total_s": round(time.perf_counter() - t0, 4)}
        logger.info(
            "router: %s: %d prompt + %d new tokens, %s%s, %d verify calls (%.2fs), accepted %s, %d drafted in %d "
            "streams, first token %.2fs, %.2fs",
            rid, len(ids), len(tokens), st.path, f" ({st.cause})" if st.cause else "", st.verify_calls, st.verify_s,
            st.accepted, st.drafted, st.streams, st.first_token_s or -1, served["total_s"],
        )  # fmt: skip
        if stream:
            last = chunk(tail, [], finish)
            last["vericache"] = served
            if (body.get("stream_options") or {}).get("include_usage"):
                last["usage"] = usage
            await resp.write(sse(last) + b"data: [DONE]\n\n")
            return resp
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text.text}, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text.text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
        if with_ids:
            choice["token_ids"] = tokens
        obj = "chat.completion" if chat else "text_completion"
        full = {"id": rid, "object": obj, "created": created, "model": router.name, "choices": [choice]}
        return web.json_response({**full, "usage": usage, "vericache": served})

    async def proxy(request, path, body):
        """Plain decoding on a verifier: the body as it came (the verifier's model name), its answer back."""
        import aiohttp

        tried: set[str] = set()
        while (server := router.verifiers.pick(avoid=tried)) is not None:
            tried.add(server.url)
            resp = None
            try:
                await router.up.describe(server)
                async with router.up.session.post(
                    server.url + path, data=json.dumps({**body, "model": server.model}), headers=router.up.headers
                ) as r:
                    resp = web.StreamResponse(status=r.status, headers={"Content-Type": r.content_type})
                    await resp.prepare(request)
                    async for data in r.content.iter_any():
                        await resp.write(data)
                    return resp
            except (UpstreamError, aiohttp.ClientError, OSError) as e:
                router.verifiers.fault(server)
                logger.warning(
                    "router: verifier %s failed a passed-on request (%s: %s)", server.url, type(e).__name__, e
                )
                if resp is not None:  # part of the answer is out: it cannot start again elsewhere
                    return resp
        return web.json_response(error_body("every verifier failed", 502, "BadGateway"), status=502)

    app = web.Application(client_max_size=router.cfg.max_body_bytes)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", complete)
    app.router.add_post("/v1/chat/completions", complete)
    app.on_startup.append(lambda _: router.start())
    app.on_cleanup.append(lambda _: router.close())
    return app


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


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


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
            f"drafters {', '.join(cfg.drafters) or 'none'}; verify api {cfg.verify_api})",
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
