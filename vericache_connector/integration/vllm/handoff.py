"""DraftHandoff: compressed prefixes passed from the connector's worker side to the proposer.

Both live in one vLLM worker process but vLLM builds them separately: the proposer with the model
runner, the connector later (once the KV cache is sized). The connector's worker side creates the one
DraftHandoff (only when the speculative config names our proposer); the proposer finds it through
vLLM's own connector registry (find_handoff: get_kv_transfer_group(), looking inside MultiConnector)
and attaches itself. The connector posts what it has: on a hit the compressed copy it fetched before
the full copy (with a pre-draft request, so drafting runs while the full copy loads); on a miss the
copy it has just compressed and saved. Posts are kept (bounded, oldest dropped) until a proposer
matches them to a running request, so an early post is not lost before the proposer attaches.

It also carries which requests are sampled with a seed (the scheduler side sees their sampling parameters,
the proposer sees only token rows): vLLM's rejection sampler draws a number of random values that depends
on how many drafts it is offered, so the proposer offers such a request none at all and its output is the
same every time, as without drafts (pre-drafts and paced drafts depend on timing).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Protocol

from ...compressors import CompressedKV

HANDOFF_CAPACITY = 32  # compressed prefixes kept for the proposer
SEEDED_CAPACITY = 4096  # seeded sampled requests remembered (oldest dropped)
ROW_KEY_TOKENS = 64  # a request's row is known by its first tokens (the prompt's, or all of a shorter one)


def row_key(prompt: list[int]) -> tuple[int, int]:
    """(n, hash of the first n tokens) of a request's prompt, n = min(len(prompt), ROW_KEY_TOKENS)."""
    n = min(len(prompt), ROW_KEY_TOKENS)
    return n, hash(tuple(prompt[:n]))


class Pacing(Protocol):
    """What the connector's worker asks the proposer before and during a load: the one object it asks."""

    attached: bool  # a proposer is attached that drafts on compressed copies
    wants_copies: bool  # compressed copies are worth bringing it (attached, or none attached yet: one may be)

    def worth_predraft(self, compressed_s: float | None, max_new: int | None) -> bool: ...

    def predraft_value(self) -> float | None: ...

    def worth_predraft_during(self, seconds: float) -> bool: ...

    def drafts_could_pay(self, batch: int | None = None) -> bool: ...


class NoProposer:
    """The answers while no proposer is attached (it attaches after the connector is built, or never): fetch a
    compressed copy whenever one could help a proposer later, promise no pre-draft, value nothing."""

    attached = False
    wants_copies = True

    def worth_predraft(self, compressed_s: float | None, max_new: int | None) -> bool:
        return True

    def predraft_value(self) -> float | None:
        return None

    def worth_predraft_during(self, seconds: float) -> bool:
        return False

    def drafts_could_pay(self, batch: int | None = None) -> bool:
        return True


class Drafter(Protocol):
    pacing: Pacing

    def predraft(
        self, prompt: list[int], prefix_len: int, compressed: CompressedKV, loaded: threading.Event | None
    ) -> None: ...


class Deferred:
    """A compressed copy made when first needed (by the proposer's draft-cache thread), not when posted: the
    copy cut from a loaded full copy costs CPU that vLLM's first step of the request needs."""

    def __init__(self, make: Callable[[], CompressedKV]):
        self._make, self._copy, self._lock = make, None, threading.Lock()

    def get(self) -> CompressedKV:
        with self._lock:
            if self._copy is None:
                self._copy, self._make = self._make(), None
            return self._copy


def materialize(copy: CompressedKV | Deferred) -> CompressedKV:
    return copy.get() if isinstance(copy, Deferred) else copy


class DraftHandoff:
    def __init__(self, capacity: int = HANDOFF_CAPACITY):
        if capacity < 1:
            raise ValueError(f"handoff capacity must be >= 1, got {capacity}")
        self.capacity, self.lock = capacity, threading.Lock()
        self.prefixes: OrderedDict[tuple[int, tuple[int, ...]], CompressedKV | Deferred] = OrderedDict()
        self.drafter: Drafter | None = None
        self.pacing: Pacing = NoProposer()  # the attached proposer's, once one attaches
        self._seeded: OrderedDict[tuple[int, int], None] = OrderedDict()

    def attach(self, drafter: Drafter) -> None:
        self.drafter, self.pacing = drafter, drafter.pacing

    def post(
        self,
        prefix: list[int],
        compressed: CompressedKV | Deferred,
        predraft_prompt: list[int] | None = None,
        loaded: threading.Event | None = None,
    ) -> None:
        """Offer `compressed` (the copy of `prefix`); with predraft_prompt, ask an attached proposer to
        draft that prompt's continuation until `loaded` is set (a pre-draft needs the copy itself)."""
        with self.lock:
            self.prefixes[(len(prefix), tuple(prefix))] = compressed
            self.prefixes.move_to_end((len(prefix), tuple(prefix)))
            while len(self.prefixes) > self.capacity:
                self.prefixes.popitem(last=False)
        drafter = self.drafter
        if predraft_prompt is not None and drafter is not None:
            drafter.predraft(predraft_prompt, len(prefix), materialize(compressed), loaded)

    def mark_seeded(self, keys: list[tuple[int, int]]) -> None:
        with self.lock:
            for key in keys:
                self._seeded[tuple(key)] = None
                self._seeded.move_to_end(tuple(key))
            while len(self._seeded) > SEEDED_CAPACITY:
                self._seeded.popitem(last=False)

    def seeded(self, row: list[int]) -> bool:
        """Whether the request of this token row is sampled with a seed (by its prompt's row_key)."""
        with self.lock:
            if not self._seeded:
                return False
            return any((n, hash(tuple(row[:n]))) in self._seeded for n in {n for n, _ in self._seeded})

    def has(self, prefix: list[int]) -> bool:
        with self.lock:
            return (len(prefix), tuple(prefix)) in self.prefixes

    def find(self, tokens: list[int]) -> tuple[int, CompressedKV | Deferred] | None:
        """The longest posted prefix of tokens that leaves at least one token after it (its copy may be
        Deferred: `materialize` it off vLLM's step)."""
        with self.lock:
            for n in sorted({n for n, _ in self.prefixes if n < len(tokens)}, reverse=True):
                got = self.prefixes.get((n, tuple(tokens[:n])))
                if got is not None:
                    return n, got
        return None


def find_handoff() -> DraftHandoff | None:
    """The DraftHandoff of this process's VeriCacheConnector, if vLLM runs one (None before the
    connector exists, or without it)."""
    try:
        from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group, has_kv_transfer_group
    except ImportError:
        return None
    if not has_kv_transfer_group():
        return None
    todo = [get_kv_transfer_group()]
    while todo:
        conn = todo.pop()
        handoff = getattr(conn, "draft_handoff", None)
        if isinstance(handoff, DraftHandoff):
            return handoff
        todo.extend(getattr(conn, "_connectors", None) or [])  # MultiConnector
    return None
