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

Direct: while a verifier that is up and not saturated decodes fewer than the direct slots' count (Router.slots,
router/slots.py: sized from what the finished requests measured) by itself, a greedy request is decoded plainly
there from the start, no drafts (its greedy output is the answer, and its full copy loads beside the store):
where the drafters' cores are the bottleneck, the verifier's spare capacity serves it faster. Of those free,
the verifier with the fewest direct requests and verify calls out.

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
from .upstream import ClientError, Pool, Server, UpstreamError, Upstreams, affinity_key

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
    path: str = "verified"  # verified | plain (sampling, no drafter) | direct (a verifier's free decode slot: it
    # decoded it by itself) | alone (verifiers saturated: a drafter computed and decoded it by itself) | fallback
    # (a fault: finished plainly on a verifier)
    cause: str | None = None
    verify_calls: int = 0
    drafted_calls: int = 0  # verify calls over drafts answered
    accepted: list[int] = field(default_factory=list)
    drafted: int = 0  # draft tokens received (including those a rejection threw away)
    streams: int = 0  # drafter requests (one, plus one per restart after a rejection)
    first_token_s: float | None = None
    verify_s: float = 0.0  # summed verify-call round trips
    verifier: str | None = None
    drafter: str | None = None


class Fault(Exception):
    pass


# A request a drafter serves alone computes its prompt itself (the connector off) and reads none of the blocks
# its lossy loads left in the drafter's prefix cache (a cache salt of its own): its output is exact.
ALONE_PARAMS = {"kv_transfer_params": {"vericache": "off"}, "cache_salt": "vericache-exact"}


class RoutedDecode:
    def __init__(
        self,
        cfg: RouterConfig,
        up: Upstreams,
        drafters: Pool,
        verifiers: Pool,
        prompt: list[int],
        want: Wanted,
        alone: bool = False,
        direct_slots: int | None = None,
    ):
        """direct_slots: the requests a verifier decodes by itself at a time now (Router.slots; default
        cfg.verifier_decode_slots)."""
        self.cfg, self.up, self.drafters, self.verifiers = cfg, up, drafters, verifiers
        self.prompt, self.want, self.alone = list(prompt), want, alone
        self.direct_slots = cfg.verifier_decode_slots if direct_slots is None else direct_slots
        self.emitted: list[int] = []
        self.done = False
        self.stats = Stats()
        self._t0 = time.perf_counter()

    async def run(self, out: asyncio.Queue) -> None:
        """Put each list of newly emitted tokens on `out`, then None; raises UpstreamError if no verifier can
        finish the request, ClientError if a verifier refuses it (a bad input: no server is marked faulted)."""
        try:
            tried: set[str] = set()
            if self.want.temperature > 0 or not self.drafters.servers:
                self.stats.path = "plain"
            elif (verifier := self._free_verifier()) is not None:  # no await since the pick: the slot is ours
                self.stats.path = "direct"
                verifier.direct += 1
                try:
                    await self._plain(verifier, out)
                except ClientError:
                    raise
                except UpstreamError as e:  # finished below, from prompt + emitted, as after any verifier fault
                    self.verifiers.fault(verifier)
                    tried.add(verifier.url)
                    self.stats.path, self.stats.cause = "fallback", str(e)
                    logger.warning("router: direct decoding failed (%s); finishing on a verifier", e)
                finally:  # a failure or a client gone never keeps the slot
                    verifier.direct -= 1
            elif self.alone:  # the verifiers are saturated: a drafter computes and decodes it by itself
                self.stats.path = "alone"
                drafter = self.drafters.pick_for(affinity_key(self.prompt))
                try:
                    await self._plain(drafter, out)
                except ClientError:
                    raise
                except UpstreamError as e:
                    self.drafters.fault(drafter)
                    self.stats.path, self.stats.cause = "fallback", str(e)
                    logger.warning("router: a drafter alone failed (%s); finishing on a verifier", e)
            else:
                verifier = self.verifiers.pick()
                try:
                    await self._speculate(verifier, out)
                except (UpstreamError, Fault) as e:
                    server = getattr(e, "server", None)
                    if server is not None and not isinstance(e, ClientError):  # a refused input is no fault
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
                except ClientError:  # vLLM refuses the request itself: every verifier would; its answer goes back
                    raise
                except UpstreamError as e:
                    self.verifiers.fault(server)
                    self.stats.cause = str(e)
                    logger.warning("router: plain decoding failed (%s); trying another verifier", e)
            if not self.done:
                raise UpstreamError(self.verifiers.servers[-1], f"every verifier failed ({self.stats.cause})")
        finally:
            await out.put(None)

    def _free_verifier(self) -> Server | None:
        """The verifier to decode this request by itself (path "direct"), or None: draft and verify."""
        c, now = self.cfg, time.monotonic()
        free = [s for s in self.verifiers.servers if s.down_until <= now and s.direct < self.direct_slots]
        free = [s for s in free if not s.saturated(c.max_verify_inflight, c.verify_slow_s)]
        return min(free, key=lambda s: s.direct + s.inflight, default=None)

    # ---- the emit rule, once per verified chunk -----------------------------------------------------------
    async def _emit(self, tokens: list[int], out: asyncio.Queue) -> None:
        before = len(self.emitted)
        self.done = emit(self.emitted, tokens, self.want.max_tokens, self.want.eos, not self.want.ignore_eos)
        if len(self.emitted) > before:
            self.stats.first_token_s = self.stats.first_token_s or time.perf_counter() - self._t0
            await out.put(self.emitted[before:])

    # ---- plain decoding on one verifier, from prompt + emitted --------------------------------------------
    async def _plain(self, server: Server, out: asyncio.Queue) -> None:
        w = self.want
        body = {
            **w.passthrough,
            "prompt": self.prompt + self.emitted,
            "max_tokens": w.max_tokens - len(self.emitted),
            "temperature": w.temperature,
            "ignore_eos": w.ignore_eos,
        }
        if server.role == "drafter":
            self.stats.drafter = server.url
            body |= ALONE_PARAMS
        else:
            self.stats.verifier = server.url
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
        drafter = self.drafters.pick_for(affinity_key(self.prompt))  # same prefix, same drafter: its cache
        self.stats.verifier, self.stats.drafter = verifier.url, drafter.url
        loop = _Loop(self, verifier, drafter)
        loop.send(0, self.cfg.open_timeout_s)  # the opening call: the verifier loads the prompt's full copy
        loop.start_stream()
        try:
            while not self.done:
                kind, *ev = await loop.events.get()
                if kind == "drafts" and ev[0] == loop.gen:
                    loop.on_drafts(ev[1])
                elif kind == "drafts-end" and ev[0] == loop.gen:
                    loop.on_stream_end(ev[1])
                elif kind == "verdict":
                    await loop.on_verdict(*ev, out)
                elif kind == "fault":
                    raise ev[0]
                if loop.call is None and not self.done and loop.ready_to_send():
                    # a verifier that has not answered drafts yet gets the opening deadline (its first forward
                    # over drafts may be slow: vLLM warms up, the full copy still loads)
                    loop.send(
                        loop.drafts_to_send(), self.cfg.verify_timeout_s if verifier.warm else self.cfg.open_timeout_s
                    )
        finally:
            loop.stop()

    async def _verify(self, server: Server, emitted: list[int], drafts: list[int], timeout_s: float, events) -> None:
        t0 = time.perf_counter()
        server.inflight += 1
        try:
            best = await self.up.verify(server, self.prompt + emitted, drafts, self.cfg.verify_api, timeout_s)
            if drafts:
                server.warm = True
                if self.stats.drafted_calls:  # a request's first call over drafts also brings its prompt's KV in
                    server.verified(time.perf_counter() - t0)  # (a load or a prefill): it says nothing of a queue
                self.stats.drafted_calls += 1
            await events.put(("verdict", drafts, best))
        except UpstreamError as e:
            await events.put(("fault", e))
        finally:
            server.inflight -= 1
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


class _Loop:
    """One request's draft / verify state (RoutedDecode._speculate): S = prompt + emitted + spec.

    spec      the drafts beyond the verified tokens
    gen       the drafter stream's generation: a restarted stream's events are told from stale ones
    sent      how many of spec the call in flight carries
    expect    all drafts sent were accepted and none came after: the stream's next draft must be this token
    """

    def __init__(self, decode: RoutedDecode, verifier: Server, drafter: Server):
        cfg = decode.cfg
        self.d, self.verifier, self.drafter = decode, verifier, drafter
        self.events: asyncio.Queue = asyncio.Queue()
        self.spec: list[int] = []
        self.gen, self.sent, self.expect = 0, 0, None
        self.stream: asyncio.Task | None = None
        self.stream_done = True
        self.call: asyncio.Task | None = None
        self.send_at = cfg.k_min if cfg.verify_api == "route" else cfg.draft_k
        self.k_cap = max(cfg.k_max, cfg.draft_k)

    def budget(self) -> int:  # tokens still to emit
        return self.d.want.max_tokens - len(self.d.emitted)

    def eos_ahead(self) -> bool:
        return not self.d.want.ignore_eos and any(t in self.d.want.eos for t in self.spec)

    def start_stream(self) -> None:
        """A drafter stream from S; drafts past the budget or the cap are never sent, so never asked for."""
        if self.stream is not None:
            self.stream.cancel()
        self.gen += 1
        m = min(self.budget() - 1, self.k_cap) - len(self.spec)
        self.stream_done, self.stream = m <= 0, None
        if m > 0:
            self.d.stats.streams += 1
            seq = self.d.prompt + self.d.emitted + self.spec
            self.stream = asyncio.create_task(self.d._drafts(self.drafter, seq, m, self.gen, self.events))

    def send(self, x: int, timeout_s: float) -> None:
        self.sent = x
        drafts = self.spec[:x]
        self.call = asyncio.create_task(
            self.d._verify(self.verifier, list(self.d.emitted), drafts, timeout_s, self.events)
        )

    def ready_to_send(self) -> bool:
        return (
            len(self.spec) >= min(self.send_at, self.budget() - 1)
            or self.stream_done
            or self.eos_ahead()
            or len(self.spec) >= self.k_cap
        )

    def drafts_to_send(self) -> int:
        x = min(len(self.spec), self.budget() - 1, self.k_cap)
        if not self.d.want.ignore_eos:
            x = min(x, next((i + 1 for i, t in enumerate(self.spec) if t in self.d.want.eos), x))
        return max(0, x)

    def on_drafts(self, ids: list[int]) -> None:
        self.d.stats.drafted += len(ids)
        if self.expect is not None:  # the stream's next token must be the one just verified
            if ids[0] != self.expect:
                self.expect = None
                self.start_stream()
                return
            ids, self.expect = ids[1:], None
        self.spec.extend(ids)

    def on_stream_end(self, error: BaseException | None) -> None:
        self.stream_done = True
        if error is not None:
            raise error
        if self.expect is not None:  # it ended on the verified path: go on from there
            self.expect = None
            self.start_stream()

    async def on_verdict(self, drafts: list[int], best: list[int], out: asyncio.Queue) -> None:
        """THE accept rule on the verifier's greedy tokens, then the emit rule; drafting goes on from there."""
        self.call = None
        n_t = verify(torch.tensor([drafts], dtype=torch.long).view(1, -1), torch.tensor([best]))
        n, t = int(n_t[0][0]), int(n_t[1][0])
        if not 0 <= n <= len(drafts):
            raise Fault(f"verdict accepted {n} of {len(drafts)} drafts")
        self.d.stats.verify_calls += 1
        self.d.stats.accepted.append(n)
        await self.d._emit(drafts[:n] + [t], out)
        if self.d.done:
            return
        ahead = self.spec[self.sent :]  # drafted while the call was in flight
        self.spec.clear()
        if n == self.sent and ahead and ahead[0] == t:  # still on the verified path: keep drafting
            self.spec.extend(ahead[1:])
        elif n == self.sent and not ahead and not self.stream_done:  # so far: check its next draft
            self.expect = t
        else:  # a rejection, or nothing more to come: draft again from prompt + emitted
            self.start_stream()
        if self.stream_done and self.expect is None and self.budget() - 1 > len(self.spec) and not self.eos_ahead():
            self.start_stream()

    def stop(self) -> None:
        for task in (self.stream, self.call):
            if task is not None:
                task.cancel()
