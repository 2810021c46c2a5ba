"""Staggered verification: when each VeriCache row verifies, and when its full KV crosses the host link.

Every verification needs the row's prompt KV reloaded into staging blocks. Two reservation rings over
the next W steps (the paper's) keep the link busy but never oversubscribed and the staging within the
device budget:

  link ring    bytes the link moves in each future step; capacity per step = rate x step time. A reload
               of R bytes takes s = ceil(R / capacity) steps and occupies s consecutive slots, at most one
               reload per slot: the plan never puts two reloads on the link at once.
  memory ring  staging bytes held in each future step: from the reload's first slot through its verify
               step; with the resident blocks it must stay within the budget.

A row starting a round picks its horizon x (`choose_horizon`) and the earliest verify step t >= now + x
whose link slots [t - s, t) and memory [t - s, t] are free; it drafts until then (x grows to t - now if
the link is busy, up to k_max). The horizon maximizes expected emitted tokens per round over its cost,

    E(x) = 1 + a + a^2 + ... + a^x = (1 - a^(x+1)) / (1 - a)      (a: per-draft acceptance probability)
    x*   = argmax_x E(x) / (x + c_verify + c_reload)              (costs in draft-step units)

and is at least the link's share: with n rows each reloading s steps' worth per round, the link keeps
up only if every row's round is >= n * s steps. a starts from the measured acceptance curve and follows
each row's observed acceptance (accepted / (accepted + rejections), with the prior as pseudo-counts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def expected_tokens(alpha: float, x: int) -> float:
    """E(x): tokens a round of x drafts emits on average (accepted drafts + the bonus token)."""
    if alpha >= 1.0:
        return x + 1.0
    return (1.0 - alpha ** (x + 1)) / (1.0 - alpha)


def choose_horizon(
    alpha: float,
    k_min: int,
    k_max: int,
    c_verify: float,
    c_reload: float,
    link_min: int = 0,
    remaining: int | None = None,
) -> int:
    """The draft horizon for one round (see the module docstring); within [k_min, k_max] and never more drafts
    than the tokens still wanted."""
    best = max(range(k_min, k_max + 1), key=lambda x: expected_tokens(alpha, x) / (x + c_verify + c_reload))
    x = min(k_max, max(best, link_min))
    if remaining is not None:
        x = min(x, max(1, remaining))
    return max(1, x)


@dataclass
class AcceptanceEstimate:
    """Per-draft acceptance probability from rounds: accepted n of k drafted (a rejection when n < k)."""

    prior: float
    weight: float = 8.0  # pseudo-drafts behind the prior
    accepted: int = 0
    rejected: int = 0

    def update(self, n: int, k: int) -> None:
        self.accepted += n
        self.rejected += int(n < k)

    @property
    def observed(self) -> float | None:
        """The rounds' own acceptance, without the prior (None before a round)."""
        seen = self.accepted + self.rejected
        return self.accepted / seen if seen else None

    @property
    def alpha(self) -> float:
        a = self.prior * self.weight + self.accepted
        r = (1.0 - self.prior) * self.weight + self.rejected
        return min(0.995, a / (a + r))


class ReservationRings:
    """The two rings over the next `window` steps (indices are absolute step numbers)."""

    def __init__(self, window: int):
        if window < 2:
            raise ValueError(f"lookahead window must be >= 2 steps, got {window}")
        self.window = window
        self.link: dict[int, str] = {}  # step -> request id whose reload owns the link then
        self.memory: dict[int, int] = {}  # step -> staging bytes held then
        self.owned: dict[str, tuple[range, int]] = {}  # owner -> (steps its staging is held, bytes)

    def advance(self, now: int) -> None:
        for ring in (self.link, self.memory):
            for t in [t for t in ring if t < now]:
                del ring[t]

    def peak_memory(self, now: int) -> int:
        return max((b for t, b in self.memory.items() if t >= now), default=0)

    def place(
        self, now: int, earliest: int, lead: int, link_steps: int, nbytes: int, free_bytes: int, owner: str
    ) -> int | None:
        """Reserve a verification at the first step t >= earliest whose reload fits: it starts `lead` steps
        before t (staging the ring) and holds the link for `link_steps` slots from then, one reload per slot;
        its `nbytes` of staging are held from its start through max(t, the end of the reload).
        -> t, or None if nothing fits in the window."""
        link_steps = max(1, link_steps)
        for t in range(max(earliest, now + lead), now + self.window):
            start = t - lead
            if any(s in self.link for s in range(start, start + link_steps)):
                continue
            held = range(start, max(t, start + link_steps) + 1)
            if any(self.memory.get(s, 0) + nbytes > free_bytes for s in held):
                continue
            self.release(owner)
            for s in range(start, start + link_steps):
                self.link[s] = owner
            for s in held:
                self.memory[s] = self.memory.get(s, 0) + nbytes
            self.owned[owner] = (held, nbytes)
            return t
        return None

    def release(self, owner: str) -> None:
        """Drop what owner reserved (its verification happened, or it finished)."""
        for s in [s for s, o in self.link.items() if o == owner]:
            del self.link[s]
        held, nbytes = self.owned.pop(owner, (range(0), 0))
        for s in held:
            if s in self.memory:
                self.memory[s] -= nbytes
                if self.memory[s] <= 0:
                    del self.memory[s]


def reload_steps(nbytes: int, link_bytes_per_s: float | None, step_s: float) -> int:
    """Link slots a reload of nbytes occupies at the current step time."""
    if link_bytes_per_s is None or step_s <= 0:
        return 1
    return max(1, math.ceil(nbytes / (link_bytes_per_s * step_s)))
