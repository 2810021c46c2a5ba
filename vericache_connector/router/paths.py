"""Which path serves a request, in one pure function: `choose_path(request, pools)` -> Choice(path, why).

What it weighs is handed in as plain values (no I/O, no clock): what the router read of the request
(Request) and what it sees of its pools now (Pools: the drafters, each verifier's state, the direct slots'
count). The first rule that applies decides:

    passed     the router has not read the request as vLLM would (openai_api.parse), or it has no drafter:
               a verifier answers the body as it came
    plain      the router holds the prompt's ids but cannot draft for it (sampling, or no drafter):
               plain decoding on a verifier (RoutedDecode)
    direct     a verifier that is up and not saturated decodes fewer requests by itself than the direct slots'
               count (router/slots.py): it decodes this one by itself, no drafts; of those free, the one with
               the fewest direct requests and verify calls out
    alone      every verifier that is up (none up: every verifier) is saturated (upstream.Server.saturated):
               a drafter computes the prompt and decodes it by itself, exact
    verified   drafts from a drafter, verified beside the store

Two places ask: the routes (routes.py), once the request is read, whether it is passed on (they hold only
the body, not yet the prompt's ids); the request's decode (decode.py), at the instant it starts, which of the
rest it takes: it takes a direct slot in the same step, so two requests never take the last one (the pools
move between the two asks). A request that starts on any path and meets a fault is finished plainly on a
verifier (path fallback, decode.py): an outcome, not a choice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    """What the router read of a request."""

    read: bool = True  # every field read as vLLM reads it (openai_api.parse); else it goes on as it came
    ids: bool = True  # the router holds the prompt's token ids (it can decode plainly itself)
    greedy: bool = True  # temperature 0


@dataclass(frozen=True)
class Verifier:
    """One verifier as the router sees it now."""

    up: bool = True  # not marked down after a fault
    saturated: bool = False  # its verify queue is long (upstream.Server.saturated)
    direct: int = 0  # requests it decodes by itself now
    inflight: int = 0  # verify calls out to it now


@dataclass(frozen=True)
class Pools:
    drafters: int
    verifiers: tuple[Verifier, ...] = ()
    direct_slots: int = 0  # requests a verifier decodes by itself at a time now (router/slots.py)

    @classmethod
    def of(cls, cfg, drafters, verifiers, direct_slots: int) -> "Pools":
        """What the router (RouterConfig cfg) sees of its pools (upstream.Pool) now."""
        now, busy, slow = time.monotonic(), cfg.max_verify_inflight, cfg.verify_slow_s
        seen = tuple(
            Verifier(s.down_until <= now, s.saturated(busy, slow), s.direct, s.inflight) for s in verifiers.servers
        )
        return cls(len(drafters.servers), seen, direct_slots)


@dataclass(frozen=True)
class Choice:
    path: str  # passed | plain | direct | alone | verified
    why: str
    verifier: int | None = None  # path direct: the verifier's index in its pool


def choose_path(request: Request, pools: Pools) -> Choice:
    """The path that serves `request` (module docstring: the first rule that applies)."""
    if not request.read:
        return Choice("passed", "the router does not read every field as vLLM would")
    if not pools.drafters:
        return Choice("plain" if request.ids else "passed", "no drafter")
    if not request.greedy:
        return Choice("plain" if request.ids else "passed", "sampling: no draft position's full distribution")
    free = [i for i, v in enumerate(pools.verifiers) if v.up and v.direct < pools.direct_slots and not v.saturated]
    if free:
        pick = min(free, key=lambda i: pools.verifiers[i].direct + pools.verifiers[i].inflight)
        return Choice("direct", f"verifier {pick} has a free decode slot", pick)
    up = [v for v in pools.verifiers if v.up] or pools.verifiers
    if all(v.saturated for v in up):
        return Choice("alone", "every verifier that is up is saturated")
    return Choice("verified", "no verifier has a free decode slot")
