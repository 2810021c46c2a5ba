"""One routed request: drafts from a drafter-role vLLM server, verified by a verifier beside the store,
each verified token handed out as soon as it is verified; on any fault, the rest on a verifier alone.

The loop is remote/drafter.py's (VerifiedDecode), with the drafting done by a vLLM server: a drafter
stream (/v1/completions, streamed, greedy) runs ahead of the verified tokens while a verify call is in
flight. S = prompt + emitted + spec, as there: `emitted` are verified, `spec` the drafts beyond them.
  - the opening call (no drafts) goes out at once: the verifier loads the prompt's full copy over its
    fast link meanwhile and answers the first token;
  - a call goes out when none is in flight and enough drafts are ready: k_min with the verify route (a
    call costs the verifier a short forward over the uncached tail), draft_k with prompt-logprobs (a
    call prefills the whole sequence there), or fewer when the stream can give no more;
  - the verdict (n, t) comes from model.sampling.verify, THE accept rule, applied to the verifier's own
    greedy tokens; emitted += d[:n] + [t] by model.sampling.emit. If all n drafts were accepted and the
    next draft is t, the stream is still on the verified path and drafts on; otherwise it is cancelled
    and a new one starts from prompt + emitted (the drafter's prefix cache keeps the prompt's blocks).
So the output is the verifier's greedy output, token for token.

Faults: a drafter that cannot be reached, errors, stalls or sends garbage, a verifier that does, or a
verdict that does not fit: logged with the cause, and the request is finished by plain decoding on a
verifier (another one if the faulty one was the verifier) from prompt + emitted. Sampling (temperature
> 0) is plain decoding on a verifier from the start: vLLM's API gives no draft position's full
distribution (prompt logprobs: the top ones of the temperature-1 distribution only), which the
rejection rule needs, so it is not applied at all rather than approximated.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import torch

from ..model.sampling import emit, verify
from .config import RouterConfig
from .upstream import Pool, Server, UpstreamError, Upstreams

logger = logging.getLogger("vericache.router")


@dataclass
class Wanted:
    """What the client asked for, as far as decoding goes."""

    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    eos: frozenset[int] = frozenset()
    passthrough: dict = field(default_factory=dict)  # other sampling fields, for plain decoding as asked


@dataclass
class Stats:
    path: str = "verified"  # verified | plain (sampling, no drafter) | fallback (a fault: finished plainly)
    cause: str | None = None
    verify_calls: int = 0
    accepted: list[int] = field(default_factory=list)
    drafted: int = 0  # draft tokens received (including those a rejection threw away)
    streams: int = 0  # drafter requests (one, plus one per restart after a rejection)
    first_token_s: float | None = None
    verify_s: float = 0.0  # summed verify-call round trips
    verifier: str | None = None
    drafter: str | None = None


class Fault(Exception):
    pass


class RoutedDecode:
    def __init__(
        self, cfg: RouterConfig, up: Upstreams, drafters: Pool, verifiers: Pool, prompt: list[int], want: Wanted
    ):
        self.cfg, self.up, self.drafters, self.verifiers = cfg, up, drafters, verifiers
        self.prompt, self.want = list(prompt), want
        self.emitted: list[int] = []
        self.done = False
        self.stats = Stats()
        self._t0 = time.perf_counter()

    async def run(self, out: asyncio.Queue) -> None:
        """Put each list of newly emitted tokens on `out`, then None; raises UpstreamError if no verifier can
        finish the request."""
        try:
            tried: set[str] = set()
            if self.want.temperature > 0 or not self.drafters.servers:
                self.stats.path = "plain"
            else:
                verifier = self.verifiers.pick()
                try:
                    await self._speculate(verifier, out)
                except (UpstreamError, Fault) as e:
                    server = getattr(e, "server", None)
                    if server is not None:
                        (self.verifiers if server.role == "verifier" else self.drafters).fault(server)
                        if server.role == "verifier":
                            tried.add(server.url)
                    self.stats.path, self.stats.cause = "fallback", str(e)
                    logger.warning(
                        "router: %s after %d verified tokens; finishing on a verifier alone", e, len(self.emitted)
                    )
            order: list[Server] = []  # the verifiers not tried yet, in turn, then the one(s) that faulted
            while (s := self.verifiers.pick(avoid=tried | {o.url for o in order})) is not None:
                order.append(s)
            order += [s for s in self.verifiers.servers if s.url in tried]  # slow is not down: once more
            for server in order:
                if self.done:
                    break
                try:
                    await self._plain(server, out)
                except UpstreamError as e:
                    self.verifiers.fault(server)
                    self.stats.cause = str(e)
                    logger.warning("router: plain decoding failed (%s); trying another verifier", e)
            if not self.done:
                raise UpstreamError(self.verifiers.servers[-1], f"every verifier failed ({self.stats.cause})")
        finally:
            await out.put(None)

    # ---- the emit rule, once per verified chunk -----------------------------------------------------------
    async def _emit(self, tokens: list[int], out: asyncio.Queue) -> None:
        before = len(self.emitted)
        self.done = emit(self.emitted, tokens, self.want.max_tokens, self.want.eos, not self.want.ignore_eos)
        if len(self.emitted) > before:
            self.stats.first_token_s = self.stats.first_token_s or time.perf_counter() - self._t0
            await out.put(self.emitted[before:])

    # ---- plain decoding on one verifier, from prompt + emitted --------------------------------------------
    async def _plain(self, server: Server, out: asyncio.Queue) -> None:
        self.stats.verifier = server.url
        w = self.want
        body = {
            **w.passthrough,
            "prompt": self.prompt + self.emitted,
            "max_tokens": w.max_tokens - len(self.emitted),
            "temperature": w.temperature,
            "ignore_eos": w.ignore_eos,
        }
        if w.seed is not None:
            body["seed"] = w.seed
        cfg = self.cfg
        async for ids, _ in self.up.stream(server, body, cfg.plain_stall_s, cfg.plain_stall_s):
            await self._emit(ids, out)
            if self.done:
                return
        self.done = True  # the server stopped (EOS, a stop token, its context length): so does the request

    # ---- drafts verified --------------------------------------------------------------------------------
    async def _speculate(self, verifier: Server, out: asyncio.Queue) -> None:
        cfg, w = self.cfg, self.want
        drafter = self.drafters.pick()
        self.stats.verifier, self.stats.drafter = verifier.url, drafter.url
        events: asyncio.Queue = asyncio.Queue()
        spec: list[int] = []
        cheap = cfg.verify_api == "route"
        send_at, k_cap = (cfg.k_min if cheap else cfg.draft_k), max(cfg.k_max, cfg.draft_k)
        gen, stream_task, stream_done, call_task, sent = 0, None, True, None, 0
        expect: int | None = None  # all drafts sent were accepted and none came after: the next must be this

        def budget() -> int:  # tokens still to emit
            return w.max_tokens - len(self.emitted)

        def start_stream() -> None:
            nonlocal gen, stream_task, stream_done
            if stream_task is not None:
                stream_task.cancel()
            gen += 1
            m = min(budget() - 1, k_cap) - len(spec)  # drafts past the budget or the cap are never sent
            stream_done, stream_task = m <= 0, None
            if m > 0:
                self.stats.streams += 1
                stream_task = asyncio.create_task(
                    self._drafts(drafter, self.prompt + self.emitted + spec, m, gen, events)
                )

        def send(x: int, timeout_s: float) -> None:
            nonlocal call_task, sent
            sent = x
            call_task = asyncio.create_task(self._verify(verifier, list(self.emitted), spec[:x], timeout_s, events))

        def drafts_to_send() -> int:
            x = min(len(spec), budget() - 1, k_cap)
            if not w.ignore_eos:
                x = min(x, next((i + 1 for i, t in enumerate(spec) if t in w.eos), x))
            return max(0, x)

        send(0, cfg.open_timeout_s)
        start_stream()
        try:
            while not self.done:
                kind, *ev = await events.get()
                if kind == "drafts" and ev[0] == gen:
                    ids = ev[1]
                    self.stats.drafted += len(ids)
                    if expect is not None:  # the stream's next token must be the one just verified
                        if ids[0] != expect:
                            expect = None
                            start_stream()
                            continue
                        ids, expect = ids[1:], None
                    spec.extend(ids)
                elif kind == "drafts-end" and ev[0] == gen:
                    stream_done = True
                    if ev[1] is not None:
                        raise ev[1]
                    if expect is not None:  # it ended on the verified path: go on from there
                        expect = None
                        start_stream()
                elif kind == "verdict":
                    drafts, best = ev
                    call_task = None
                    n_t = verify(torch.tensor([drafts], dtype=torch.long).view(1, -1), torch.tensor([best]))
                    n, t = int(n_t[0][0]), int(n_t[1][0])
                    if not 0 <= n <= len(drafts):
                        raise Fault(f"verdict accepted {n} of {len(drafts)} drafts")
                    self.stats.verify_calls += 1
                    self.stats.accepted.append(n)
                    await self._emit(drafts[:n] + [t], out)
                    if self.done:
                        break
                    ahead = spec[sent:]  # drafted while the call was in flight
                    spec.clear()
                    if n == sent and ahead and ahead[0] == t:  # still on the verified path: keep drafting
                        spec.extend(ahead[1:])
                    elif n == sent and not ahead and not stream_done:  # so far: check its next draft
                        expect = t
                    else:  # a rejection, or nothing more to come: draft again from prompt + emitted
                        start_stream()
                    eos_ahead = not w.ignore_eos and any(x in w.eos for x in spec)
                    if stream_done and expect is None and budget() - 1 > len(spec) and not eos_ahead:
                        start_stream()
                elif kind == "fault":
                    raise ev[0]
                if call_task is None and not self.done:
                    eos_ahead = not w.ignore_eos and any(t in w.eos for t in spec)
                    if len(spec) >= min(send_at, budget() - 1) or stream_done or eos_ahead or len(spec) >= k_cap:
                        send(drafts_to_send(), cfg.verify_timeout_s)
        finally:
            for task in (stream_task, call_task):
                if task is not None:
                    task.cancel()

    async def _verify(self, server: Server, emitted: list[int], drafts: list[int], timeout_s: float, events) -> None:
        t0 = time.perf_counter()
        try:
            best = await self.up.verify(server, self.prompt + emitted, drafts, self.cfg.verify_api, timeout_s)
            await events.put(("verdict", drafts, best))
        except UpstreamError as e:
            await events.put(("fault", e))
        finally:
            self.stats.verify_s += time.perf_counter() - t0

    async def _drafts(self, server: Server, seq: list[int], m: int, gen: int, events) -> None:
        """One drafter stream: greedy, up to m tokens after seq, each chunk put on `events` as it comes."""
        w, cfg = self.want, self.cfg
        body = {"prompt": seq, "max_tokens": m, "temperature": 0.0, "ignore_eos": w.ignore_eos}
        try:
            async for ids, _ in self.up.stream(server, body, cfg.draft_first_s, cfg.draft_stall_s):
                if ids:
                    await events.put(("drafts", gen, ids))
            await events.put(("drafts-end", gen, None))
        except UpstreamError as e:
            await events.put(("drafts-end", gen, e))
