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

Here: Router (the pools, the tokenizer, the direct slots: what every request shares), make_app and main. The
handlers are routes.py's Routes; which path serves a request, paths.py's choose_path.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal

from ..metrics import add_metrics_route
from .config import RouterConfig, config_from_args, router_token
from .decode import Wanted
from .observe import RouterMetrics
from .openai_api import NEUTRAL, Parsed, parse
from .slots import DirectSlots
from .upstream import Pool, UpstreamError, Upstreams

logger = logging.getLogger("vericache.router")


class Router:
    def __init__(self, cfg: RouterConfig, token: bytes | None):
        self.cfg, self.token = cfg, token
        self.drafters = Pool.of(cfg.drafters, "drafter", cfg.down_s)
        self.verifiers = Pool.of(cfg.verifiers, "verifier", cfg.down_s)
        for server in self.verifiers.servers:
            server.near = server.url in cfg.near_verifiers
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

    # ---- a request --------------------------------------------------------------------------------------
    def parse(self, path: str, body: dict) -> Parsed | None:
        """The request as vLLM reads it, or None: it goes to a verifier as it came (openai_api.parse)."""
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
    """The app: the routes (routes.py: each handler decides where a request goes, Reply shapes the answer) and
    /metrics; the router's upstream session opens with the app and closes with it."""
    from aiohttp import web

    from .routes import Routes

    app = web.Application(client_max_size=router.cfg.max_body_bytes)
    add_metrics_route(app, router.metrics.m)
    Routes(router).add_to(app)
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
