"""One routed request: the path chosen (paths.py) and taken, each verified token handed out as soon as it is
verified; on any fault, the rest on a verifier alone.

Verified: drafts from a drafter-role vLLM server, checked by a verifier beside the store (draft_loop.py:
remote/drafter.py's loop with the drafting done by a vLLM server). So the output is the verifier's greedy
output, token for token.

Direct: while a verifier that is up and not saturated decodes fewer than the direct slots' count (Router.slots,
router/slots.py: sized from what the finished requests measured) by itself, a greedy request is decoded plainly
there from the start, no drafts (its greedy output is the answer, and its full copy loads beside the store):
where the drafters' cores are the bottleneck, the verifier's spare capacity serves it faster. Of those free,
the verifier with the fewest direct requests and verify calls out. Alone: while every verifier that is up is
saturated, a drafter computes the prompt and decodes it by itself (its connector off: exact).

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

from ..model.sampling import emit
from .config import RouterConfig
from .draft_loop import DraftLoop, Fault
from .paths import Choice, Pools, Request, choose_path
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
        direct_slots: int | None = None,
    ):
        """direct_slots: the requests a verifier decodes by itself at a time now (Router.slots; default
        cfg.verifier_decode_slots)."""
        self.cfg, self.up, self.drafters, self.verifiers = cfg, up, drafters, verifiers
        self.prompt, self.want = list(prompt), want
        self.direct_slots = cfg.verifier_decode_slots if direct_slots is None else direct_slots
        self.emitted: list[int] = []
        self.done = False
        self.stats = Stats()
        self.choice: Choice | None = None  # the path it took, and why (paths.py)
        self._t0 = time.perf_counter()

    def choose(self) -> Choice:
        """The path for this request, from what the router sees of its pools now (paths.choose_path)."""
        pools = Pools.of(self.cfg, self.drafters, self.verifiers, self.direct_slots)
        return choose_path(Request(greedy=not self.want.temperature > 0), pools)

    async def run(self, out: asyncio.Queue) -> None:
        """Put each list of newly emitted tokens on `out`, then None; raises UpstreamError if no verifier can
        finish the request, ClientError if a verifier refuses it (a bad input: no server is marked faulted)."""
        try:
            tried: set[str] = set()
            self.choice = self.choose()
            self.stats.path = self.choice.path  # plain | direct | alone | verified (fallback: after a fault)
            if self.choice.path == "direct":  # no await since the choice: the slot is ours
                verifier = self.verifiers.servers[self.choice.verifier]
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
            elif self.choice.path == "alone":  # the verifiers are saturated: a drafter computes and decodes it
                drafter = self.drafters.pick_for(affinity_key(self.prompt))
                try:
                    await self._plain(drafter, out)
                except ClientError:
                    raise
                except UpstreamError as e:
                    self.drafters.fault(drafter)
                    self.stats.path, self.stats.cause = "fallback", str(e)
                    logger.warning("router: a drafter alone failed (%s); finishing on a verifier", e)
            elif self.choice.path == "verified":
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

    # ---- the emit rule, once per verified chunk -----------------------------------------------------------
    async def deliver(self, tokens: list[int], out: asyncio.Queue) -> None:
        """Emit `tokens` (model.sampling.emit: the budget and EOS) and put what was emitted on `out`."""
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
            await self.deliver(ids, out)
            if self.done:
                return
        self.done = True  # the server stopped (EOS, a stop token, its context length): so does the request

    # ---- drafts verified (draft_loop.py) ------------------------------------------------------------------
    async def _speculate(self, verifier: Server, out: asyncio.Queue) -> None:
        drafter = self.drafters.pick_for(affinity_key(self.prompt))  # same prefix, same drafter: its cache
        self.stats.verifier, self.stats.drafter = verifier.url, drafter.url
        await DraftLoop(self, verifier, drafter).run(out)
