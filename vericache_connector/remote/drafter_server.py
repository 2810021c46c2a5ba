"""`vericache drafter`: a serving node far from the store, answering generate requests over HTTP.

    VERICACHE_STORE_URL=redis://... VERICACHE_VERIFIER_TOKEN_FILE=/run/secrets/verifier/token \\
    vericache drafter --verifier tcp://vericache-verifier:8477 --host 0.0.0.0 --port 8000
    curl -s localhost:8000/v1/generate -d '{"prompt": "def fib(n):", "max_new_tokens": 64}'

POST /v1/generate runs RemotePrefixCache.generate (one request at a time; others queue): with --verifier,
a hit fetches only the compressed copy and is verified next to the store (remote/drafter.py). The prompt
is text ("prompt", tokenized with the model's tokenizer) or token ids ("prompt_ids"); the answer is JSON:
tokens and their text, path, timings, bytes fetched. "mode" picks what runs (drafter_api.MODES, shown by
`vericache drafter --help`). GET /health answers once the model is loaded. Bodies are bounded
(MAX_BODY_BYTES) and checked; a bad one is a 400 naming the field. GET /metrics: Prometheus metrics
(DrafterMetrics: requests, verify calls, accepted drafts per call, queue length, fallbacks; docs/operations.md#metrics).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import signal
import threading
import time

import torch

from storage_backends import redact_url, stored_prefix_len

from ..engine.speculative import DecodeConfig, autoregressive_decode
from ..metrics import COUNT_BUCKETS, Metrics, add_metrics_route
from ..model.sampling import sample
from ..store.config import RemoteCacheConfig
from ..store.full_copy import stream_full_copy
from .cli_args import store_config
from .drafter_api import MODES, mode_error
from .prefix_cache import RemotePrefixCache

logger = logging.getLogger("vericache.drafter")
MAX_BODY_BYTES = 1 << 20


class DrafterService:
    def __init__(self, engine, cfg: RemoteCacheConfig):
        self.engine, self.cfg = engine, cfg
        self.cache = RemotePrefixCache(engine, cfg)
        self.local = RemotePrefixCache(engine, dataclasses.replace(cfg, verifier=None)) if cfg.verifier else self.cache
        self.lock = threading.Lock()
        self.metrics = DrafterMetrics()

    def close(self) -> None:
        self.cache.close()
        self.local.close()

    def parse(self, body: dict) -> tuple[str, list[int], DecodeConfig]:
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        mode = body.get("mode", "vericache")
        if not isinstance(mode, str) or mode not in MODES:
            raise ValueError(mode_error(mode))
        text, ids = body.get("prompt"), body.get("prompt_ids")
        if (text is None) == (ids is None):
            raise ValueError("give the prompt as 'prompt' (text) or as 'prompt_ids' (token ids), one of the two")
        if text is not None:
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"prompt must be non-empty text, got {type(text).__name__} {str(text)[:40]!r}")
            if self.engine.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; give prompt_ids")
            ids = self.engine.encode(text)
        vocab = self.engine.model.cfg.vocab_size
        if not (isinstance(ids, list) and ids and all(type(t) is int and 0 <= t < vocab for t in ids)):
            raise ValueError(f"prompt_ids must be a non-empty list of token ids in [0, {vocab}) (or give 'prompt')")
        k = body.get("draft_k", 8)
        decode = DecodeConfig(
            max_new_tokens=body.get("max_new_tokens", 64),
            draft_k=k,
            k_min=min(2, k) if isinstance(k, int) else 2,
            k_max=max(32, k) if isinstance(k, int) else 32,
            temperature=body.get("temperature", 0.0),
            seed=body.get("seed", 0),
            stop_at_eos=bool(body.get("stop_at_eos", True)),
        )
        for name in ("max_new_tokens", "draft_k", "seed"):
            if type(getattr(decode, name)) is not int:
                raise ValueError(f"{name} must be an integer, got {getattr(decode, name)!r}")
        self.engine.check_length(len(ids), decode.max_new_tokens)
        return mode, ids, decode

    def generate(self, mode: str, ids: list[int], decode: DecodeConfig) -> dict:
        """The answer: mode, prompt_tokens, how it was served and what it cost (_serve), the tokens' text."""
        out = {"mode": mode, "prompt_tokens": len(ids), **self._serve(mode, ids, decode)}
        tok = self.engine.tokenizer
        return {**out, "text": tok.decode(out["tokens"], skip_special_tokens=True) if tok is not None else None}

    def _serve(self, mode: str, ids: list[int], decode: DecodeConfig) -> dict:
        with self.lock:
            t0 = time.perf_counter()
            if mode in ("vericache", "local"):
                res = (self.cache if mode == "vericache" else self.local).generate(ids, decode)
                self.metrics.decoded(mode, res, verifier=self.cfg.verifier is not None)
                tm = res.timings
                return dict(
                    tokens=res.tokens,
                    path=res.path,
                    total_s=tm.total_s,
                    first_token_s=tm.first_token_s,
                    compressed_s=tm.compressed_s,
                    draft_ready_s=tm.draft_ready_s,
                    first_draft_s=tm.first_draft_s,
                    full_arrived_s=tm.full_arrived_s,
                    bytes_compressed=res.bytes_compressed,
                    bytes_full=res.bytes_full,
                    verify_calls=len(res.stats.draft_lengths),
                    mean_accepted=res.stats.mean_accepted(),
                    draft_steps=res.draft_steps,
                    draft_s=res.stats.draft_s,
                    verify_wait_s=res.stats.verify_s,
                    error=res.error,
                )
            out = self._full_kv(ids, decode, t0) if mode == "full-kv" else self._recompute(ids, decode, t0)
            return {**out, "total_s": time.perf_counter() - t0}

    def _recompute(self, ids, decode, t0) -> dict:
        pre = self.engine.prefill(ids)
        first = time.perf_counter() - t0
        return dict(tokens=self.engine.generate_full([pre], decode)[0], path="recompute", first_token_s=first)

    def _full_kv(self, ids, decode, t0) -> dict:
        """The baseline: fetch the whole full copy over this node's link, then plain full-KV decoding."""
        model, store = self.engine.model, self.local.store
        stored = stored_prefix_len(len(ids), self.cfg.chunk_size)
        cache = model.new_cache(1, len(ids) + decode.max_new_tokens + 2)
        path, nbytes = "fetch", 0

        def put(layer, k, v):
            cache.keys[layer][0, :, :stored] = k
            cache.values[layer][0, :, :stored] = v

        try:
            if stored:
                shape = cache.keys[0][0, :, :stored].shape
                pull = stream_full_copy(store, ids[:stored], len(cache.keys), self.cfg.timeout_s, put, shape)
                nbytes = self.local.client.call(pull, 600.0)
        except Exception as e:  # a miss or a fault: the baseline recomputes, as a plain engine would
            logger.warning("full-kv: full copy not fetched (%s: %s); recomputing", type(e).__name__, e)
            stored, path = 0, "recompute"
        arrived = time.perf_counter() - t0
        cache.lengths[0] = stored
        with torch.inference_mode():  # the cache was filled outside it (on the store loop's thread)
            rest = torch.tensor([ids[stored:]], device=model.device)
            logits, _ = model(rest, torch.arange(stored, len(ids), device=model.device)[None], cache, last_only=True)
            first = sample(logits[:, -1], decode.temperature, decode.generator())[0]
            first_s = time.perf_counter() - t0
            start = torch.tensor([len(ids)], device=model.device)
            tokens = autoregressive_decode(model, cache, first, start, decode)[0]
        return dict(tokens=tokens, path=path, first_token_s=first_s, full_arrived_s=arrived, bytes_full=nbytes)


class DrafterMetrics(Metrics):
    """The drafter's Prometheus metrics (vericache_drafter_*), served at GET /metrics."""

    VERIFIED = "verified"  # the path of a request the verifier checked to the end
    NOT_FALLBACKS = (VERIFIED, "miss", "local")  # a miss and a prompt too short to store never use the verifier

    def __init__(self):
        super().__init__("vericache_drafter")
        self.requests = self.counter(
            "requests", "Requests answered, by mode and path (the answer's path).", ["mode", "path"]
        )
        self.errors = self.counter("request_errors", "Requests refused (400: a bad body) or failed (500).", ["status"])
        self.seconds = self.histogram("request_seconds", "Seconds to answer a request, queueing included.", ["mode"])
        self.in_flight = self.gauge(
            "requests_in_flight", "Requests received and not answered yet (one runs at a time)."
        )
        self.queued = self.gauge("queued_requests", "Requests waiting for the one running (the queue length).")
        self._in_flight = 0  # changed on the app's event loop only
        self.verify_calls = self.counter("verify_calls", "Verify calls of requests the verifier checked to the end.")
        self.accepted = self.histogram(
            "accepted_drafts", "Drafts the verifier accepted per verify call.", buckets=COUNT_BUCKETS
        )
        self.fallbacks = self.counter(
            "fallbacks",
            "Hits in mode vericache (with --verifier) not verified to the end, finished on this node, by path: "
            "the verifier failed mid-request (verifier-fallback*) or was not used (hit, full-only, ...).",
            ["path"],
        )
        self.bytes_read = self.counter("bytes_read", "KV bytes fetched from the store per copy.", ["copy"])

    def running(self, n: int) -> None:
        """A request came in (+1) or was answered (-1)."""
        self._in_flight += n
        self.in_flight.set(self._in_flight)
        self.queued.set(max(0, self._in_flight - 1))

    def answered(self, mode: str, out: dict, seconds: float) -> None:
        self.requests.labels(mode, out["path"]).inc()
        self.seconds.labels(mode).observe(seconds)
        self.bytes_read.labels("compressed").inc(out.get("bytes_compressed") or 0)
        self.bytes_read.labels("full").inc(out.get("bytes_full") or 0)

    def decoded(self, mode: str, res, verifier: bool) -> None:
        if res.path == self.VERIFIED:
            self.verify_calls.inc(len(res.stats.draft_lengths))
            for n in res.stats.accepted[0] if res.stats.accepted else ():
                self.accepted.observe(n)
        elif mode == "vericache" and verifier and res.path not in self.NOT_FALLBACKS:
            self.fallbacks.labels(res.path).inc()


def make_app(service: DrafterService):
    from aiohttp import web

    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vericache-drafter")

    async def health(_):
        return web.Response(text="ok")

    async def generate(request):
        m = service.metrics
        try:
            body = json.loads(await request.read())
            mode, ids, decode = service.parse(body)
        except (ValueError, TypeError) as e:  # JSONDecodeError is a ValueError
            m.errors.labels("400").inc()
            return web.json_response({"error": " ".join(str(e).split())[:500]}, status=400)
        loop = asyncio.get_running_loop()
        m.running(+1)
        t0 = time.perf_counter()
        try:
            out = await loop.run_in_executor(pool, service.generate, mode, ids, decode)
        except Exception as e:  # noqa: BLE001 - one failed request, the node serves on
            logger.exception("generate failed")
            m.errors.labels("500").inc()
            return web.json_response({"error": f"{type(e).__name__}: {e}"[:500]}, status=500)
        finally:
            m.running(-1)
        m.answered(mode, out, time.perf_counter() - t0)
        return web.json_response(out)

    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/generate", generate)
    add_metrics_route(app, service.metrics)
    app.on_cleanup.append(lambda _: asyncio.get_running_loop().run_in_executor(None, pool.shutdown))
    return app


def main(args) -> int:
    """The CLI entry (cli.py `drafter`): serve until SIGTERM/SIGINT."""
    from aiohttp import web

    from ..engine import VeriCacheEngine

    cfg = store_config(
        args,
        compressor=args.compressor,
        verifier=args.verifier,
        verifier_token_file=args.token_file,
        verifier_timeout_s=args.verifier_timeout_s,
        verifier_load_timeout_s=args.verifier_load_timeout_s,
    )
    from ..draft import DraftConfig

    draft = DraftConfig(layout=args.draft_layout, weights=args.draft_weights)
    engine = VeriCacheEngine.from_pretrained(args.model, draft=draft)
    warm_s = engine.warm_up(cfg.compressor)  # before /health answers: requests do not pay one-time costs
    service = DrafterService(engine, cfg)

    async def serve() -> None:
        runner = web.AppRunner(make_app(service), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        port = runner.addresses[0][1]
        print(
            f"vericache drafter: serving {engine.model_name} on http://{args.host}:{port} "
            f"(store {redact_url(cfg.url)}, verifier {args.verifier or 'none'}; warmed up in {warm_s:.1f}s)",
            flush=True,
        )
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
        await runner.cleanup()

    try:
        asyncio.run(serve())
    finally:
        service.close()
    return 0
