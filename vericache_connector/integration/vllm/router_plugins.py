"""The plug-ins of `vericache router`'s vLLM servers: two ASGI middlewares that vLLM's --middleware loads
(stable path: vericache_connector.vllm_router).

RouterOnly, on a DRAFTER-role server (connector/drafter.py: it loads only compressed copies, so its output is
drafts, never answers), refuses every request without the router token as a Bearer token, except GET /health,
/ping, /metrics and /version. A middleware, not vLLM's --api-key: --api-key guards only /v1, /v2, /inference
and /cohere, and vLLM 0.32 also generates on /invocations (SageMaker) and /generative_scoring, outside them.

    VERICACHE_ROUTER_TOKEN_FILE=/run/secrets/router/token python -m vllm.entrypoints.openai.api_server \\
      --model MODEL --served-model-name smollm2-drafts --middleware vericache_connector.vllm_router.RouterOnly \\
      --kv-transfer-config '{"kv_connector": "VeriCacheConnector", ..., "kv_connector_extra_config":
                             {"store": "redis://...", "compressor": "kivi4", "role": "drafter"}}'

VerifyRoute, on the VERIFIER server beside the store, adds POST /v1/vericache/verify:

    python -m vllm.entrypoints.openai.api_server --model MODEL --enable-prefix-caching \\
      --middleware vericache_connector.vllm_router.VerifyRoute \\
      --kv-transfer-config '{"kv_connector": "VeriCacheConnector", ...}'      # the connector's normal role

Body {"prompt": [ids], "drafts": [ids]} -> {"best": [k + 1 ids], "cached": n}: best[j] is this server's greedy
token after prompt + drafts[:j] (its argmax there), for j = 0..k, all from ONE forward over the sequence; the
router applies the accept rule (model.sampling.verify) to them, so its output is this server's greedy output.

Why not /v1/completions with prompt_logprobs (remote/openai_verifier.py): vLLM 0.32 sets
skip_reading_prefix_cache on every request with prompt_logprobs, so such a request neither reads vLLM's
prefix cache nor the connector's load: each call prefills the whole sequence and computes logits at every
position (on this CPU about 3x a whole 32-token decode, per call). This route submits the same request to
the engine with skip_reading_prefix_cache=False (a SamplingParams field): the prompt's KV comes from the
prefix cache, or from the store through the connector over the fast link on the request's first call,
and only the uncached tail is computed. vLLM then fills prompt-logprob rows only from the first uncached
position; the rows read here (from len(prompt) - 1 on) are used only when the engine reports that many
cached tokens or fewer and no preemption (which restarts a prefill from the cache); otherwise the call is
run again without the cache. detokenize=False keeps the unfilled rows away from the tokenizer.

The route sits under /v1, behind vLLM's own --api-key check when the server has one. vLLM's --middleware
adds ASGI middleware, not routes: this one adds the route to the app the first time the app calls it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
import uuid

from ...router.config import router_token

ROUTE = "/v1/vericache/verify"
MIDDLEWARE = "vericache_connector.vllm_router.VerifyRoute"
GUARD = "vericache_connector.vllm_router.RouterOnly"
OPEN_PATHS = ("/health", "/ping", "/metrics", "/version")  # GET/HEAD: nothing the model generated
REFUSED = (
    b'{"error": {"message": "this vLLM server runs the VeriCache connector in the drafter role: its output is '
    b'drafts, never answers; only vericache router may call it", "type": "Forbidden", "code": 403}}'
)
MAX_DRAFTS = 256
MAX_BODY_BYTES = 4 << 20
logger = logging.getLogger("vllm.vericache")


class RouterOnly:
    """ASGI middleware: every request needs `Authorization: Bearer <router token>`, except GET/HEAD of
    OPEN_PATHS; others get a 403 (deny by default: new vLLM endpoints are covered too)."""

    def __init__(self, app):
        self.app = app
        self._digest = hashlib.sha256(router_token()).digest()  # no token: the server does not start

    def _allowed(self, scope) -> bool:
        path = scope.get("path", "").removeprefix(scope.get("root_path", "") or "")
        if scope["type"] == "http" and scope.get("method") in ("GET", "HEAD") and path in OPEN_PATHS:
            return True
        auth = dict(scope.get("headers") or ()).get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(hashlib.sha256(token.strip()).digest(), self._digest)

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or self._allowed(scope):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        await send({"type": "http.response.start", "status": 403, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": REFUSED})


class VerifyRoute:
    """ASGI middleware (vLLM's --middleware) that installs ROUTE on the app once, then passes every call on."""

    def __init__(self, app):
        self.app = app
        self._installed = False

    async def __call__(self, scope, receive, send):
        if not self._installed and scope.get("app") is not None:
            from starlette.routing import Route

            scope["app"].router.routes.insert(0, Route(ROUTE, verify, methods=["POST"]))
            self._installed = True
            logger.info("VeriCache: %s serves vericache router's verify calls", ROUTE)
        await self.app(scope, receive, send)


def parse(body: bytes) -> tuple[list[int], list[int]]:
    """(prompt, drafts) of a verify body; ValueError naming the bad field."""
    try:
        obj = json.loads(body)
    except ValueError as e:
        raise ValueError(f"the body is not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError("the body must be a JSON object")
    out = []
    for name, least, most in (("prompt", 1, None), ("drafts", 0, MAX_DRAFTS)):
        ids = obj.get(name)
        if not (isinstance(ids, list) and all(type(t) is int and t >= 0 for t in ids)):
            raise ValueError(f"{name} must be a list of token ids (non-negative integers)")
        if len(ids) < least or (most is not None and len(ids) > most):
            raise ValueError(f"{name} holds {len(ids)} tokens, expected {least}..{most or 'any'}")
        out.append(ids)
    return out[0], out[1]


async def verify(request):
    from starlette.responses import JSONResponse

    body = await request.body()
    if len(body) > MAX_BODY_BYTES:
        return JSONResponse({"error": f"body over {MAX_BODY_BYTES} bytes"}, status_code=413)
    try:
        prompt, drafts = parse(body)
        engine = request.app.state.engine_client
        t0 = time.perf_counter()
        best, cached, again = await greedy_tokens(engine, prompt, drafts, use_cache=True)
        if again:  # rows the engine did not compute: once more, without the cache (exact, slower)
            logger.warning("VeriCache verify: %s; computing the whole sequence", again)
            best, cached, again = await greedy_tokens(engine, prompt, drafts, use_cache=False)
            if again:
                raise RuntimeError(f"prompt logprobs unusable without the cache too: {again}")
    except ValueError as e:
        return JSONResponse({"error": " ".join(str(e).split())[:500]}, status_code=400)
    except Exception as e:  # noqa: BLE001 - the router treats it as a verifier fault
        if refused_input(e):  # vLLM refuses the input itself (a token id out of vocabulary, ...): the caller's
            return JSONResponse({"error": " ".join(str(e).split())[:500]}, status_code=400)
        logger.exception("VeriCache verify failed")
        return JSONResponse({"error": f"{type(e).__name__}: {e}"[:500]}, status_code=500)
    return JSONResponse({"best": best, "cached": cached, "seconds": round(time.perf_counter() - t0, 4)})


def refused_input(e: BaseException) -> bool:
    """vLLM's own verdict that a request is bad (VLLMClientError: validation, not found, ...), not a fault."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:
        return False
    return isinstance(e, VLLMClientError)


async def greedy_tokens(engine, prompt: list[int], drafts: list[int], use_cache: bool):
    """(best, cached, problem): the engine's argmax after prompt + drafts[:j] for j = 0..k (rank-1 entries of
    its prompt logprobs, then the greedy token it generates), the tokens it read from cache, and why the rows
    cannot be used (None: they can)."""
    from vllm import SamplingParams

    params = SamplingParams(
        max_tokens=1,
        temperature=0.0,
        prompt_logprobs=1 if drafts else None,
        skip_reading_prefix_cache=not use_cache,
        detokenize=False,
    )
    rid = f"vericache-verify-{uuid.uuid4().hex}"
    final = None
    async for out in engine.generate({"prompt_token_ids": prompt + drafts}, params, rid):
        final = out
    if final is None or not final.outputs or not final.outputs[0].token_ids:
        raise RuntimeError("the engine generated no token")
    token = int(final.outputs[0].token_ids[0])
    if not drafts:
        return [token], final.num_cached_tokens, None
    cached, metrics = final.num_cached_tokens, final.metrics
    preempted = getattr(metrics, "num_preemptions", None)
    if use_cache and (cached is None or preempted is None or cached > len(prompt) - 1 or preempted):
        return None, cached, f"{cached} cached tokens, {preempted} preemptions"
    rows, n = final.prompt_logprobs, len(prompt)
    best = []
    for j, d in enumerate(drafts):
        row = rows[n + j] if rows is not None and n + j < len(rows) else None
        top = [int(t) for t, lp in (row or {}).items() if getattr(lp, "rank", None) == 1]
        if not top or d not in row:  # each row holds the token that followed and the rank-1 token
            return None, cached, f"prompt-logprob row {n + j} does not hold draft {d} and a rank-1 token"
        best.append(min(top))  # ties: the lowest id, as the greedy sampler's argmax picks
    return best + [token], cached, None
