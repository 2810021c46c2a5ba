"""The connector's drafter role: a vLLM server whose output is DRAFTS, never answers.

    VERICACHE_ROUTER_TOKEN_FILE=/run/secrets/router/token python -m vllm.entrypoints.openai.api_server \\
      --model MODEL --served-model-name smollm2-drafts \\
      --middleware vericache_connector.integration.vllm.draft_role.RouterOnly \\
      --kv-transfer-config '{"kv_connector": "VeriCacheConnector", ..., "kv_connector_extra_config":
                             {"store": "redis://...", "compressor": "kivi4", "role": "drafter"}}'

A drafter-role server sits far from the store (slow link). For a prompt with a stored prefix it loads ONLY
the compressed copy, decodes it (a quantizer's copy holds every token: its dequantized K/V take the place
of the full KV in vLLM's own blocks) and decodes on it at vLLM speed; it never reads the full copy and never
writes to the store (its KV is lossy). `vericache router` checks what it drafts against a verifier server
beside the store, so what a user sees is the verifier's output.

Lossy output must not reach a user by mistake, so the server answers only the router:
  RouterOnly   an ASGI middleware (vLLM's --middleware) that refuses every request without the router token
               as a Bearer token, except GET /health, /ping, /metrics and /version. A middleware, not vLLM's
               --api-key: --api-key guards only /v1, /v2, /inference and /cohere, and vLLM 0.32 also
               generates on /invocations (SageMaker) and /generative_scoring, outside them.
  check_server the connector refuses to start in this role unless the router token is set and the
               server's command line names RouterOnly, and unless the compressor keeps every token
               (token-dropping copies have no K/V for the dropped positions to put into vLLM's blocks).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import time

import torch
from vllm.logger import init_logger

from ...compressors import GROUPS, Compressor, LayeredKV, get_compressor
from ...router.config import router_token
from .metadata import LoadSpec, VeriCacheMetadata
from .paged_layout import scatter_tokens
from .scheduler import VeriCacheConnectorScheduler, connector_off
from .worker import VeriCacheConnectorWorker

logger = init_logger("vllm.vericache")
GUARD = "vericache_connector.integration.vllm.draft_role.RouterOnly"
OPEN_PATHS = ("/health", "/ping", "/metrics", "/version")  # GET/HEAD: nothing the model generated
MAX_CANDIDATES = 32  # chunk-aligned prefixes tried per lookup, longest first
REFUSED = (
    b'{"error": {"message": "this vLLM server runs the VeriCache connector in the drafter role: its output is '
    b'drafts, never answers; only vericache router may call it", "type": "Forbidden", "code": 403}}'
)


def keeps_every_token(compressor: Compressor) -> bool:
    """A quantizer's copy (kivi, int8, fp8, turboquant, ...) holds every token; token dropping does not."""
    quantizers = next(names for names in GROUPS.values() if "kivi" in names)
    return compressor.name in quantizers


def check_server(compressor: Compressor | str, runs_proposer: bool, name: str | None = None) -> None:
    """What a drafter-role server must have before it serves: ValueError naming what is missing.
    `compressor`: the resolved compressor (`name`: its spec as configured, for the errors), or that spec."""
    name = compressor if isinstance(compressor, str) else name or compressor.spec
    if not keeps_every_token(get_compressor(compressor)):  # a resolved compressor is used as it is
        raise ValueError(
            f"the drafter role needs a compressor that keeps every token (a quantizer: kivi4, int8, fp8, "
            f"turboquant-k4v3, ...): {name!r} drops tokens, whose K/V vLLM's blocks would then lack"
        )
    if runs_proposer:
        raise ValueError("the drafter role does not run the compressed-KV proposer: drop --speculative-config")
    router_token()  # ValueError when missing: the guard below would refuse every request
    if not any(GUARD in line for line in _command_lines()):
        raise ValueError(
            f"a drafter-role server answers only the router: start it with --middleware {GUARD} "
            f"(on the command line), so that requests without the router token are refused"
        )


def _command_lines(depth: int = 4) -> list[str]:
    """This process's command line and its parents' (vLLM's engine core runs in a child of the API server)."""
    lines, pid = [], os.getpid()
    for _ in range(depth):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                lines.append(f.read().replace(b"\0", b" ").decode("utf-8", "replace"))
            with open(f"/proc/{pid}/stat", "rb") as f:
                pid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
        if pid <= 1:
            break
    return lines


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


class DrafterScheduler(VeriCacheConnectorScheduler):
    """Loads the longest stored prefix that has a compressed copy; never saves (its KV is lossy)."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        rid, prompt = request.request_id, list(request.prompt_token_ids or [])
        if self._loaded.pop(rid, None) is not None or connector_off(request):  # asked again: its load failed
            return 0, False
        stored = self.stored_len(prompt)
        lengths, copy = range(stored, num_computed_tokens, -self.cfg.chunk_size), self.compressor.spec
        try:
            for n in list(lengths)[:MAX_CANDIDATES]:
                if self.client.call(self.client.store.has_compressed(prompt[:n], copy)):
                    self._lookups[rid] = n
                    return n - num_computed_tokens, True
        except Exception as e:  # down or slow: a miss (vLLM computes the prompt), never a failed request
            logger.warning("store lookup failed for %s (%s: %s): computing the prompt", rid, type(e).__name__, e)
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        rid = request.request_id
        if num_external_tokens > 0 and rid in self._lookups:
            found = self._lookups.pop(rid)
            prompt = list(request.prompt_token_ids or [])
            block_ids = list(blocks.get_block_ids()[0])
            self._loads[rid] = LoadSpec(rid, prompt[:found], block_ids, found - num_external_tokens, prompt)
            self._loaded[rid] = found

    def build_connector_meta(self, scheduler_output) -> VeriCacheMetadata:
        meta = VeriCacheMetadata(loads=list(self._loads.values()))
        self._loads.clear()
        for r in scheduler_output.scheduled_new_reqs:  # a load that failed past a valid part: nothing to repair
            if r.num_computed_tokens < self._loaded.get(r.req_id, 0):
                del self._loaded[r.req_id]
        return meta


class DrafterWorker(VeriCacheConnectorWorker):
    """Loads the compressed copy, decoded, into the request's blocks; never the full copy, never saves."""

    def wait_for_save(self, meta: VeriCacheMetadata) -> None:
        if meta.saves:  # DrafterScheduler sends none; lossy KV must never reach the store
            logger.error("drafter role: %d saves dropped (lossy KV is never stored)", len(meta.saves))

    async def _load(self, spec: LoadSpec, idle: bool = True) -> None:  # the worker's signature; idle unused here
        t0, n = time.perf_counter(), len(spec.prefix)
        first, last = spec.start // self.block_size, n // self.block_size
        ids = torch.tensor(spec.block_ids[first:last])
        lo = first * self.block_size
        try:
            got = await asyncio.wait_for(
                self.client.store.get_compressed(spec.prefix, self.compressor.spec), self.cfg.timeout_s
            )
            if got is None:
                raise LookupError("the compressed copy is gone")
            fetched = time.perf_counter() - t0
            comp = LayeredKV.from_payload(*got)  # checksums passed; it must also fit the model
            self.compressor.validate(comp, n, len(self._views), self.num_kv_heads, self.head_dim)
            await asyncio.to_thread(self._put, comp, ids, lo, n)
            logger.info(
                "drafter: %s: compressed copy of %d tokens loaded (%d bytes in %.2fs, into blocks after %.2fs); "
                "the full copy is never read",
                spec.req_id,
                n - spec.start,
                comp.nbytes,
                fetched,
                time.perf_counter() - t0,
            )
        except BaseException as e:  # noqa: BLE001 - vLLM computes the blocks instead
            logger.warning(
                "drafter: compressed load of %s failed (%s: %s): vLLM computes its %d blocks",
                spec.req_id,
                type(e).__name__,
                e,
                len(ids),
            )
            with self._lock:
                self._failed_blocks.update(spec.block_ids[first:last])
        finally:
            self._load_ended(spec.req_id)

    def _put(self, comp: LayeredKV, ids: torch.Tensor, lo: int, n: int) -> None:
        for layer, (kv, vv) in enumerate(self._views):
            k, v = comp.layer_kv(layer, kv.dtype)  # [H_kv, n, D]: every token, dequantized
            if k.shape[1] != n or v.shape[1] != n:
                raise ValueError(f"compressed copy layer {layer} holds {k.shape[1]} of {n} tokens")
            scatter_tokens(kv, ids, k[:, lo:n])
            scatter_tokens(vv, ids, v[:, lo:n])
