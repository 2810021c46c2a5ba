"""The scheduler side's store lookups, off vLLM's scheduler loop, behind a circuit breaker.

vLLM asks `get_num_new_matched_tokens` inside its scheduler loop: a lookup waited on there stops every running
request for as long as the store takes (a stalled store: `timeout_s` per new request, one after another).
So a lookup runs on the store client's loop and is waited on for LOOKUP_WAIT_S at most; a slower one goes on
while vLLM's step goes on (the connector answers None: vLLM keeps the request waiting and asks again next step).
A lookup that fails or takes `timeout_s` marks the store down (one log line, counted as `store_marked_down`):
for DOWN_S no request is looked up (counted as `lookups_skipped`: they compute their prompts at once, as if
nothing were stored) and nothing is saved; then the next lookup tries the store again, and the first answer
closes the breaker ("store answers again").
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field
from typing import Callable

from vllm.logger import init_logger

from storage_backends import StoreUnavailable, redact_url

logger = init_logger("vllm.vericache")
LOOKUP_WAIT_S = 0.02  # a healthy store answers within this: the request is decided on vLLM's first ask
DOWN_S = 30.0  # a store that failed a lookup is not asked again for this long


class StoreBreaker:
    """Whether the store is marked down (a lookup failed or timed out lately)."""

    def __init__(self, url: str, down_s: float = DOWN_S, clock: Callable[[], float] = time.monotonic):
        self.url, self.down_s, self.clock = redact_url(url), down_s, clock
        self.down_until: float | None = None  # marked down until then (None: closed)

    def is_down(self) -> bool:
        return self.down_until is not None and self.clock() < self.down_until

    def failed(self, error: BaseException) -> bool:
        """A lookup failed: the store is marked down for down_s. True where it was not down already."""
        was_up = self.down_until is None
        self.down_until = self.clock() + self.down_s
        if was_up:
            logger.warning(
                "VeriCache: store %s did not answer a lookup (%s: %s): marked down for %.0fs; requests compute "
                "their prompts and nothing is saved until it answers again",
                self.url,
                type(error).__name__,
                error,
                self.down_s,
            )
        return was_up

    def answered(self) -> None:
        if self.down_until is not None:
            self.down_until = None
            logger.info("VeriCache: store %s answers again", self.url)


@dataclass
class Lookup:
    """One request's lookup in flight on the store client's loop."""

    future: concurrent.futures.Future
    since: float = field(default_factory=time.monotonic)

    def result(self, wait_s: float, timeout_s: float) -> int | BaseException | None:
        """The tokens found, the error it raised (a timeout past timeout_s), or None while it runs."""
        if not self.future.done():
            concurrent.futures.wait([self.future], wait_s)
        if not self.future.done():
            if time.monotonic() - self.since < timeout_s:
                return None
            self.future.cancel()
            return StoreUnavailable(f"lookup took over {timeout_s:g}s")
        if self.future.cancelled():
            return StoreUnavailable("lookup cancelled")
        error = self.future.exception()  # down, refused, dropped: the store's failure
        return error if error is not None else self.future.result()

    def cancel(self) -> None:
        self.future.cancel()
