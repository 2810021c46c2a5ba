"""The router's HTTP routes, one method each (Routes): GET /health and /v1/models, POST /v1/completions and
/v1/chat/completions. A completion is read (openai_api.parse), its path chosen (paths.choose_path: passed on to
a verifier as it came, or decoded by the router: decode.py), and answered as vLLM's server answers (Reply),
streamed or whole; then counted (observe.py). Imported when the app is made (server.make_app): it needs aiohttp.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import TYPE_CHECKING

from aiohttp import web

from .decode import RoutedDecode, Wanted
from .openai_api import CHAT, COMPLETIONS, Parsed, Reply, Text, error_body, sse
from .paths import Pools, Request, choose_path
from .upstream import ClientError, UpstreamError, affinity_key

if TYPE_CHECKING:
    from .server import Router

logger = logging.getLogger("vericache.router")


def failed(message: str, status: int, kind: str):
    return web.json_response(error_body(message, status, kind), status=status)


class Routes:
    """The handlers of one Router's app."""

    def __init__(self, router: Router):
        self.router = router

    def add_to(self, app) -> None:
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post(COMPLETIONS, self.complete)
        app.router.add_post(CHAT, self.complete)

    async def health(self, _):
        return web.Response(text="ok")

    async def models(self, _):
        router = self.router
        try:
            await router.ready()
        except (UpstreamError, ValueError, OSError) as e:
            return failed(str(e), 503, "ServiceUnavailable")
        card = {"id": router.name, "object": "model", "created": int(time.time()), "owned_by": "vericache"}
        return web.json_response({"object": "list", "data": [card]})

    async def complete(self, request):
        """Answer, then count how (observe.py)."""
        t0, served = time.perf_counter(), {}
        resp = await self._answer_or_pass(request, served)
        self.router.metrics.answered(
            request.path, served.get("path", "failed"), time.perf_counter() - t0, served.get("stats")
        )
        return resp

    async def _answer_or_pass(self, request, served: dict):
        router, path = self.router, request.path
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
        # the body only, no prompt ids yet: passed on, or decoded here (decode.py chooses again as it starts)
        pools = Pools.of(router.cfg, router.drafters, router.verifiers, router.slots.limit)
        if choose_path(Request(read=req is not None, ids=False), pools).path == "passed":
            served["path"] = "passed"
            return await self._proxy(request, path, body)
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
            return await self._proxy(request, path, body)
        return await self._answer(request, req, ids, want, served)

    async def _answer(self, request, req: Parsed, ids: list[int], want: Wanted, served_as: dict):
        """Run the loop; stream each verified chunk, or answer once at the end. A client that goes away
        stops the loop (within one verify call) with one log line."""
        router = self.router
        rid = f"{'chatcmpl' if req.chat else 'cmpl'}-{uuid.uuid4().hex}"
        reply, t0 = Reply(rid, int(time.time()), router.name, req), time.perf_counter()
        decode = RoutedDecode(
            router.cfg, router.up, router.drafters, router.verifiers, ids, want, direct_slots=router.slots.limit
        )
        out: asyncio.Queue = asyncio.Queue()
        task = asyncio.create_task(decode.run(out))
        text, resp = Text(router.tokenizer, ids), None
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

    async def _proxy(self, request, path, body):
        """Plain decoding on a verifier: the body as it came (the verifier's model name), its answer back."""
        import aiohttp

        router = self.router
        tried: set[str] = set()
        key = affinity_key(body.get("prompt") if "prompt" in body else json.dumps(body.get("messages")))
        while (server := router.verifiers.place(key, avoid=tried)) is not None:  # same prefix, same server
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

            server.passed += 1  # the proxy's placement weighs what each server has out (Pool.place)
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
            finally:
                server.passed -= 1
        return failed("every verifier failed", 502, "BadGateway")


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
