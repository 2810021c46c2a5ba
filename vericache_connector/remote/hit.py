"""What both paths of a remote hit share (prefix_cache.py, verified_hit.py): the request, its result and
timings, the full copy's arrival, and the clock that notes when round 1 drafted."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass

import torch

from ..engine.speculative import DecodeConfig, SpecStats
from ..model.kv_cache import KVCache

logger = logging.getLogger("vericache.remote")


@dataclass
class Timings:
    """Seconds since generate() was called."""

    compressed_s: float | None = None  # compressed copy fetched and checked
    draft_ready_s: float | None = None  # draft cache built from it
    first_draft_s: float | None = None  # first token drafted on the compressed KV
    drafted_until_s: float | None = None  # last draft of round 1 (it drafts on until the full copy is in)
    full_arrived_s: float | None = None  # full prefix KV complete (streamed in, or computed here)
    first_token_s: float | None = None  # first verified token
    total_s: float = 0.0


@dataclass
class RemoteResult:
    tokens: list[int]
    path: str  # local | miss | hit | hit-recompute | full-only | fallback-recompute
    stats: SpecStats
    timings: Timings
    stored_tokens: int = 0  # prompt tokens looked up in (or written to) the store
    bytes_compressed: int = 0  # fetched
    bytes_full: int = 0  # fetched
    wrote: bool = False  # this request wrote copies (now visible)
    error: str | None = None  # the fault behind a fallback
    draft_steps: int = 0  # verified path: tokens drafted on the compressed KV, thrown-away ones included


class Arrival:
    """The full copy streaming into the full cache; wait() recomputes it here if the stream failed."""

    def __init__(self, recompute):
        self.event, self.recompute = threading.Event(), recompute
        self.error: BaseException | None = None
        self.nbytes, self.done_at = 0, None
        self.task: asyncio.Task | None = None  # the stream, on the store loop

    def ready(self) -> bool:
        return self.event.is_set()

    def wait(self) -> None:
        self.event.wait()
        if self.done_at is None:  # the stream failed: nothing writes into the cache any more
            logger.warning(
                "full copy stream failed (%s: %s); recomputing the prefix KV locally",
                type(self.error).__name__,
                self.error,
            )
            self.recompute()
            self.done_at = time.perf_counter()

    async def stop(self) -> None:
        """On the store loop: cancel the stream if it still runs, and wait for it to end. The stream
        task started before this one runs (the loop runs callbacks in order), so `task` is set."""
        if self.task is not None and not self.task.done():
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)


class DraftClock:
    """Stands in for the model in speculative_decode; notes when the first and the last draft forward of
    round 1 (the ones before the first verify pass) return. Draft forwards run `drafter`."""

    def __init__(self, model, draft: KVCache, drafter=None):
        self.model, self.cfg, self.draft, self.drafter = model, model.cfg, draft, drafter or model
        self.first_draft = self.round1_end = None
        self.verified = False

    def __call__(self, ids, positions, cache, **kw):
        out = (self.drafter if cache is self.draft else self.model)(ids, positions, cache, **kw)
        if cache is not self.draft:
            self.verified = True
        elif not self.verified:
            self.round1_end = time.perf_counter()
            self.first_draft = self.first_draft or self.round1_end
        return out


@dataclass
class Request:
    prefix: list[int]  # the stored part of the prompt
    suffix: torch.Tensor  # [1, P] the rest, fed through the first draft and verify passes
    decode: DecodeConfig
    t0: float

    @property
    def extra(self) -> int:  # cache room past the prefix
        return self.suffix.shape[1] + self.decode.cache_headroom


def since(t: float | None, t0: float) -> float | None:
    return None if t is None else t - t0


def err(e: BaseException | None) -> str | None:
    return None if e is None else f"{type(e).__name__}: {e}"


def shown_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}s"
