"""The router's upstream vLLM servers: pools of drafters and verifiers, and the three calls it makes.

  stream()    POST /v1/completions with stream=true and token ids in: the token ids of each chunk as it
              comes (a drafter's drafts; a verifier's plain decoding)
  verify()    one verify call: the verifier's greedy token after prompt + drafts[:j], j = 0..k, from one
              forward: POST /v1/vericache/verify (integration/vllm/router_plugins.py: prompt KV from vLLM's
              prefix cache or the connector), or with --verify-api prompt-logprobs the plain OpenAI API
              (/v1/completions, prompt_logprobs=1: vLLM prefills the whole sequence on every call)
  tokenize()  POST /tokenize on a verifier: its own tokenization and chat template, so that the router's
              prompt is token for token the verifier's own

Every failure is an UpstreamError naming the server and the cause (refused, HTTP status, timeout, a body
that does not fit); the router then finishes the request on a verifier alone. A server that failed is
skipped for `down_s` (unless every server of its pool is down).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from ..model.sampling import top_token

MAX_ANSWER_BYTES = 64 << 20
AFFINITY_TOKENS = 256  # a prompt's first stored chunk: requests that share it go to the same drafter
PLACED = 4096  # prefixes whose server a passed-on request remembers (Pool.place)


CLIENT_STATUSES = (400, 413, 422)  # vLLM's answers to a request it refuses: the request's fault, not the server's


class UpstreamError(Exception):
    def __init__(self, server: "Server", cause: str):
        super().__init__(f"{server.role} {server.url}: {cause}")
        self.server, self.cause = server, cause


class ClientError(UpstreamError):
    """The server refused the request itself (HTTP 400/413/422, or an error event with that code inside a
    streamed answer): the server is fine, and the client gets the server's answer as it came."""

    def __init__(self, server: "Server", status: int, answer: dict):
        self.status, self.answer = status, answer
        message = answer.get("error", {}).get("message") if isinstance(answer.get("error"), dict) else None
        super().__init__(server, f"refused the request (HTTP {status}: {str(message or answer)[:300]})")


def refusal(server: "Server", status: int, data: bytes) -> ClientError:
    try:
        answer = json.loads(data)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        answer = {"error": {"message": data[:300].decode("utf-8", "replace"), "code": status}}
    return ClientError(server, status, answer)


@dataclass
class Server:
    url: str
    role: str  # "drafter" | "verifier"
    model: str | None = None  # its served model name (GET /v1/models)
    root: str | None = None  # its model path (for the router's tokenizer)
    max_model_len: int | None = None
    down_until: float = 0.0
    warm: bool = False  # a verifier that has answered a call with drafts (the first may take the open deadline)
    inflight: int = 0  # verify calls out now (a verifier's queue, as the router sees it)
    direct: int = 0  # requests it decodes by itself now (path "direct": RouterConfig.verifier_decode_slots)
    near: bool = False  # beside the store: it loads a stored prefix fastest (--near-verifier)
    passed: int = 0  # requests passed on to it as they came, out now
    verify_s: float | None = None  # EMA of its verify calls' round trips (drafted calls only)
    verify_at: float = 0.0  # when the last one came back

    def verified(self, seconds: float) -> None:
        self.verify_s = seconds if self.verify_s is None else 0.8 * self.verify_s + 0.2 * seconds
        self.verify_at = time.monotonic()

    def saturated(self, max_inflight: int, slow_s: float, memory_s: float = 10.0) -> bool:
        """Its queue is long: max_inflight verify calls out, or calls that took slow_s lately."""
        recent = self.verify_s is not None and time.monotonic() - self.verify_at < memory_s
        return self.inflight >= max_inflight or (recent and self.verify_s >= slow_s)


@dataclass
class Pool:
    servers: list[Server]
    down_s: float
    _turn: itertools.count = field(default_factory=itertools.count)
    _placed: OrderedDict = field(default_factory=OrderedDict)  # affinity key -> URL its requests went to

    @classmethod
    def of(cls, urls: list[str], role: str, down_s: float) -> "Pool":
        return cls([Server(u, role) for u in urls], down_s)

    def pick(self, avoid: set[str] = frozenset()) -> Server | None:
        """The next server in turn that is up and not in `avoid`; else the next not in `avoid`; else None."""
        if not self.servers:
            return None
        start, now = next(self._turn), time.monotonic()
        ring = [self.servers[(start + i) % len(self.servers)] for i in range(len(self.servers))]
        ring = [s for s in ring if s.url not in avoid]
        return next((s for s in ring if s.down_until <= now), ring[0] if ring else None)

    def pick_for(self, key: int, avoid: set[str] = frozenset()) -> Server | None:
        """The server `key` (a prompt's leading tokens) goes to, by rendezvous hashing: the same prefix lands
        on the same server, whose prefix cache then holds it, and a server that is down (or in `avoid`) hands
        only its own prefixes to the next one by score."""
        now = time.monotonic()
        ring = sorted((s for s in self.servers if s.url not in avoid), key=lambda s: _score(key, s.url), reverse=True)
        return next((s for s in ring if s.down_until <= now), ring[0] if ring else None)

    def place(self, key: int, avoid: set[str] = frozenset()) -> Server | None:
        """Where a request passed on as it came goes (a prefix-aware proxy): the server its prefix went to
        last, while that is up (its prefix cache holds it); a new prefix to a near server (beside the store: it
        loads a stored prefix fastest) unless that has more passed-on requests out than the least busy other,
        else to the least busy; ties by rendezvous score."""
        now = time.monotonic()
        ring = [s for s in self.servers if s.url not in avoid]
        up = [s for s in ring if s.down_until <= now] or ring
        if not up:
            return None
        held = next((s for s in up if s.url == self._placed.get(key)), None)
        if held is None:
            near, far = [s for s in up if s.near], [s for s in up if not s.near]
            least = lambda group: min(group, key=lambda s: (s.passed, -_score(key, s.url)))  # noqa: E731
            if near and (not far or least(near).passed <= least(far).passed):
                held = least(near)
            else:
                held = least(far or near)
        self._placed[key] = held.url
        self._placed.move_to_end(key)
        while len(self._placed) > PLACED:
            self._placed.popitem(last=False)
        return held

    def fault(self, server: Server) -> None:
        server.down_until = time.monotonic() + self.down_s


def _score(key: int, url: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}|{url}".encode(), digest_size=8).digest(), "big")


def affinity_key(prompt) -> int:
    """What requests sharing a prefix have in common: their first tokens (ids), or characters (text)."""
    head = prompt[:AFFINITY_TOKENS] if isinstance(prompt, list) else str(prompt)[: 4 * AFFINITY_TOKENS]
    return int.from_bytes(hashlib.blake2b(repr(head).encode(), digest_size=8).digest(), "big")


class Upstreams:
    """One aiohttp session for every upstream call; the router token as the Bearer token."""

    def __init__(self, token: bytes | None, on_auth_failure=lambda: None):
        import aiohttp

        self.on_auth_failure = on_auth_failure  # an upstream answered 401 / 403 (the router's metrics count it)
        self.headers = {"Content-Type": "application/json"}
        if token:
            self.headers["Authorization"] = "Bearer " + token.decode()
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))

    async def close(self) -> None:
        await self.session.close()

    async def _json(self, server: Server, method: str, path: str, body: dict | None, timeout_s: float) -> dict:
        import aiohttp

        try:
            async with asyncio.timeout(timeout_s):
                async with self.session.request(
                    method, server.url + path, data=None if body is None else json.dumps(body), headers=self.headers
                ) as r:
                    data = bytearray()
                    async for chunk in r.content.iter_chunked(1 << 16):  # the whole answer, bounded
                        data += chunk
                        if len(data) > MAX_ANSWER_BYTES:
                            raise UpstreamError(server, f"answer over {MAX_ANSWER_BYTES} bytes")
                    if r.status in (401, 403):
                        self.on_auth_failure()
                    if r.status in CLIENT_STATUSES:
                        raise refusal(server, r.status, bytes(data))
                    if r.status != 200:
                        raise UpstreamError(server, f"HTTP {r.status}: {bytes(data[:300]).decode('utf-8', 'replace')}")
        except TimeoutError:
            raise UpstreamError(server, f"no answer within {timeout_s:g}s") from None
        except aiohttp.ClientError as e:
            raise UpstreamError(server, f"{type(e).__name__}: {e}") from None
        try:
            return json.loads(data)
        except ValueError:
            raise UpstreamError(server, "answer is not JSON") from None

    async def describe(self, server: Server, timeout_s: float = 10.0) -> Server:
        """Fill in the server's model name, model path and context length (once)."""
        if server.model is None:
            got = await self._json(server, "GET", "/v1/models", None, timeout_s)
            try:
                m = got["data"][0]
                server.model, server.root = str(m["id"]), m.get("root")
                server.max_model_len = m.get("max_model_len")
            except (KeyError, IndexError, TypeError):
                raise UpstreamError(server, "/v1/models lists no model") from None
        return server

    async def tokenize(self, server: Server, body: dict, timeout_s: float) -> list[int]:
        await self.describe(server)
        got = await self._json(server, "POST", "/tokenize", {**body, "model": server.model}, timeout_s)
        tokens = got.get("tokens") if isinstance(got, dict) else None
        if not (isinstance(tokens, list) and all(type(t) is int for t in tokens)):
            raise UpstreamError(server, "/tokenize answered no token ids")
        return tokens

    async def verify(self, server: Server, prompt: list[int], drafts: list[int], api: str, timeout_s: float):
        """The verifier's greedy tokens after prompt + drafts[:j], j = 0..len(drafts)."""
        if api == "route":
            got = await self._json(
                server, "POST", "/v1/vericache/verify", {"prompt": prompt, "drafts": drafts}, timeout_s
            )
            best = got.get("best") if isinstance(got, dict) else None
        else:
            await self.describe(server)
            body = {
                "model": server.model,
                "prompt": prompt + drafts,
                "max_tokens": 1,
                "temperature": 0.0,
                "prompt_logprobs": 1,
                "return_token_ids": True,
            }
            got = await self._json(server, "POST", "/v1/completions", body, timeout_s)
            try:
                choice = got["choices"][0]
                plp, n = choice["prompt_logprobs"], len(prompt)
                best = [top_token(plp[n + j]) for j in range(len(drafts))] + [int(choice["token_ids"][0])]
            except (KeyError, IndexError, TypeError, ValueError) as e:
                raise UpstreamError(server, f"unexpected answer ({type(e).__name__}: {e})") from None
        if not (isinstance(best, list) and len(best) == len(drafts) + 1 and all(type(t) is int for t in best)):
            raise UpstreamError(server, f"a verify answer of {len(drafts) + 1} tokens expected")
        return best

    async def stream(self, server: Server, body: dict, first_s: float, stall_s: float):
        """Yield (token ids, finish_reason) per chunk of a streamed /v1/completions (token ids in); the first
        chunk may take first_s, each later one stall_s."""
        import aiohttp

        await self.describe(server)
        body = {**body, "model": server.model, "stream": True, "return_token_ids": True}
        wait = first_s
        try:
            async with self.session.post(
                server.url + "/v1/completions", data=json.dumps(body), headers=self.headers
            ) as r:
                if r.status in (401, 403):
                    self.on_auth_failure()
                if r.status in CLIENT_STATUSES:
                    raise refusal(server, r.status, await r.content.read(1 << 16))
                if r.status != 200:
                    detail = (await r.content.read(300)).decode("utf-8", "replace")
                    raise UpstreamError(server, f"HTTP {r.status}: {detail}")
                while True:
                    async with asyncio.timeout(wait):
                        line = await r.content.readline()
                    if not line:
                        raise UpstreamError(server, "the stream ended without [DONE]")
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    if line == b"data: [DONE]":
                        return
                    try:
                        event = json.loads(line[5:])
                        if isinstance(event, dict) and isinstance(event.get("error"), dict):  # vLLM's error event
                            code = event["error"].get("code")
                            if code in CLIENT_STATUSES:
                                raise ClientError(server, code, event)
                            raise UpstreamError(server, f"error event: {str(event['error'].get('message'))[:300]}")
                        choice = event["choices"][0]
                        ids = [int(t) for t in choice.get("token_ids") or []]
                    except (ValueError, KeyError, IndexError, TypeError) as e:
                        raise UpstreamError(
                            server, f"a stream chunk that does not parse ({type(e).__name__})"
                        ) from None
                    if ids or choice.get("finish_reason"):
                        wait = stall_s
                        yield ids, choice.get("finish_reason")
        except TimeoutError:
            raise UpstreamError(server, f"stream silent for {wait:g}s") from None
        except (aiohttp.ClientError, ValueError) as e:  # ValueError: a line over aiohttp's limit
            raise UpstreamError(server, f"{type(e).__name__}: {e}") from None
