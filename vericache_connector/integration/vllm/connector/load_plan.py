"""Load or recompute: how much of a stored prefix the connector loads, decided per request.

A stored prefix can come over the store link (the worker copies it into vLLM's blocks) or be computed by
vLLM's own prefill. Loading pays only where it is faster, and what is faster depends on what is already
queued on each: a slow link loses to the CPU, a busy CPU loses to the link. The scheduler side measures
both as the server runs and decides when vLLM asks it for a request's external tokens:

    R      the load pipeline's rate, tokens/s: what the workers moved (bytes, in full-copy tokens) over the
           seconds at least one load was in flight (LinkMeter: samples of SPELL_S of loading, or a shorter
           spell that ended, closed on the worker and reported with the next step), an EMA over samples
    a, b   a vLLM step that runs n tokens takes a + b n seconds: least squares over recent steps (a step's
           forward as the worker times it, from bind_connector_metadata to build_connector_worker_meta: a
           proposer's drafting after it, which would count as prefill cost, is left out)
    L      tokens still to load ahead on the link (a fluid backlog: each load adds its tokens, R drains it)
    C      prefill tokens still to compute ahead of this request (the requests admitted before it)

For a request whose next n prompt tokens are stored (and s more to compute after them), loading the first
x of the n and computing the rest has its KV ready after

    T(x) = max(link(x), C b) + (n - x + s) b          link(x) = (L + x) / R for x > 0, 0 for x = 0

(the request computes only once its load is in, and only once the CPU has done what is ahead of it). While
the CPU is busy anyway, a leading part comes over the link for free: the best x can be all of n, none, or
a leading part. With our proposer, a load's idle CPU time is not lost: it pre-drafts on the compressed copy
meanwhile, and vLLM later accepts those drafts in a few steps. Its measured worth v (decode seconds saved
per second of pre-drafting, reported by the worker) is credited: T(x) -= min(v (link(x) - C b), (m - 1) b1),
m the request's max_tokens and b1 = a + b a decode step's time; but only among loads whose KV is ready within
TTFT_SLACK of computing it (a cache never makes the first token slower than no cache: the credit breaks ties).
What is computed here also takes the CPU from the requests vLLM is running: each of the N it ran in its last
step waits (n - x) b longer for its tokens, while a load makes only its own request wait. So among those
loads x* = argmin T(x) + N (n - x) b over chunk multiples (a near-tie goes to the load while others run: one
coin-flip recompute at concurrency 8 cost 13% of the output, results/vllm_bench/20261206-220313); within 2% of
the minimum the largest x wins. Until both rates are measured they are taken as equal: the queues then split
concurrent requests between the link and the CPU, and measure both.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass

EMA = 0.3  # weight of a new busy spell's rate
STEPS_KEPT = 64  # (tokens, seconds) of recent vLLM steps for the step-time fit
TIE = 0.02  # within this fraction of the best time, the larger load wins
TTFT_SLACK = 0.05  # the pre-draft credit never buys a load whose KV is ready later than this past computing it
SPELL_S = 0.5  # seconds of loading per rate sample (or a shorter spell that ended: every load in; LinkMeter)
PROBE_WAIT_S = 30.0  # a request waits at most this long for the first load to measure the link: the
# measure reaches the scheduler with the step that ran alongside the load (a 1,600-token prefill here: ~5 s;
# a stalled store fails the load within its timeout_s first)


@dataclass
class Plan:
    load: int  # tokens to load (a chunk multiple, 0..n)
    n: int  # stored tokens beyond what vLLM has
    t_load_s: float | None  # T(load), T(n) and T(0) as estimated (None: no estimate yet)
    t_all_s: float | None
    t_none_s: float | None
    rate_tok_s: float | None  # R
    prefill_tok_s: float | None  # 1 / b
    link_ahead: int  # L, tokens
    cpu_ahead: int  # C, tokens
    predraft_value: float | None = None  # v
    ready_s: float | None = None  # when the KV is ready with this choice (T without the pre-draft credit)
    running: int = 0  # N, requests vLLM ran in its last step (a recompute delays each)

    @property
    def decision(self) -> str:
        return "load" if self.load == self.n else "recompute" if self.load == 0 else "partial"

    def describe(self) -> str:
        f = lambda x: "-" if x is None else f"{x:.2f}s"  # noqa: E731
        r = lambda x: "unmeasured" if x is None else f"{x:.0f} tok/s"  # noqa: E731
        return (
            f"{self.decision} {self.load} of {self.n} stored tokens (est. {f(self.t_load_s)}; all {f(self.t_all_s)}, "
            f"none {f(self.t_none_s)}); link {r(self.rate_tok_s)} with {self.link_ahead} tokens ahead, prefill "
            f"{r(self.prefill_tok_s)} with {self.cpu_ahead} tokens ahead, {self.running} running"
            + ("" if self.predraft_value is None else f"; pre-drafts save {self.predraft_value:.2f} s per s of load")
        )


class StepTimes:
    """vLLM's step time as a + b n (n: tokens the step runs), fitted on recent steps."""

    def __init__(self):
        self.samples: collections.deque[tuple[int, float]] = collections.deque(maxlen=STEPS_KEPT)

    def add(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.samples.append((tokens, seconds))

    def fit(self) -> tuple[float, float] | None:
        """(a, b), or None until steps of different sizes were seen (a prefill and a decode step)."""
        if len(self.samples) < 3:
            return None
        n = len(self.samples)
        mx = sum(t for t, _ in self.samples) / n
        my = sum(s for _, s in self.samples) / n
        sxx = sum((t - mx) ** 2 for t, _ in self.samples)
        if sxx < 1e-9 or max(t for t, _ in self.samples) < 4 * min(t for t, _ in self.samples):
            return None  # no spread in step sizes: b is not identified
        b = sum((t - mx) * (s - my) for t, s in self.samples) / sxx
        if b <= 0:
            return None
        return max(0.0, my - b * mx), b


class LoadPlanner:
    """The scheduler side's view of the link and the CPU (module docstring). Thread-safe."""

    def __init__(self, chunk: int, clock=time.monotonic):
        self.chunk, self.clock = chunk, clock
        self.steps = StepTimes()
        self.rate: float | None = None  # R, tokens/s
        self._lock = threading.Lock()
        self._loads: dict[str, int] = {}  # in flight: request -> tokens
        self._backlog, self._at = 0.0, clock()  # L as of `_at`
        self._prefill: dict[str, int] = {}  # request -> prefill tokens it still has to compute
        self.predraft_value: float | None = None  # v: decode s saved per s of pre-drafting (the proposer)
        self.running = 0  # N: requests vLLM ran in its last step

    # ---- what the server reports ----
    def link_report(self, tokens: float, busy_s: float) -> None:
        """The workers' closed rate samples since their last report (LinkMeter): `tokens` (full-copy tokens'
        worth of bytes) moved in `busy_s` seconds of loading. Nothing while a sample is still open."""
        if tokens > 0 and busy_s > 0:
            r = tokens / busy_s
            with self._lock:
                self.rate = r if self.rate is None else (1 - EMA) * self.rate + EMA * r

    def load_started(self, rid: str, tokens: int) -> None:
        """`rid` loads `tokens` (counted from the decision on: requests decided in the same step see it)."""
        with self._lock:
            self._drain()
            self._backlog += tokens - self._loads.pop(rid, 0)  # decided again (not scheduled last time)
            if tokens > 0:  # (0: computed after all: nothing of it on the link)
                self._loads[rid] = tokens

    def load_finished(self, rid: str) -> None:
        with self._lock:
            self._drain()
            self._loads.pop(rid, None)
            if not self._loads:
                self._backlog = 0.0

    def forget(self, rid: str) -> None:
        """`rid` finished (or was aborted): nothing of it stays queued."""
        with self._lock:
            self._prefill.pop(rid, None)
            if self._loads.pop(rid, None) is not None and not self._loads:
                self._backlog = 0.0

    def prefill_left(self, rid: str, tokens: int) -> None:
        """`rid` has `tokens` prompt tokens still to compute (0: done, or finished)."""
        with self._lock:
            if tokens > 0:
                self._prefill[rid] = tokens
            else:
                self._prefill.pop(rid, None)

    def ran(self, requests: int) -> None:
        """vLLM's last step ran `requests` requests (the scheduler side, as it builds the step's metadata)."""
        self.running = max(0, int(requests))

    def waits_for_probe(self, rid: str) -> bool:
        """Whether `rid`'s decision waits for the link's first measure: unmeasured, another request's load is on
        it and the CPU has another request's prefill ahead (so waiting leaves neither idle)."""
        with self._lock:
            if self.rate is not None:
                return False
            loading = any(r != rid for r in self._loads)  # (their own suffixes come after their loads)
            return loading and any(t > 0 and r not in self._loads for r, t in self._prefill.items() if r != rid)

    def _drain(self) -> None:
        now = self.clock()
        if self.rate is not None:
            self._backlog = max(0.0, self._backlog - self.rate * (now - self._at))
        self._at = now

    # ---- the decision ----
    def plan(self, rid: str, start: int, found: int, prompt_len: int, max_new: int | None = None) -> Plan:
        """How many stored tokens past `start` (what vLLM has) `rid` loads: the prefix is stored up to `found`,
        the prompt is `prompt_len` long, it makes up to `max_new` tokens (module docstring); a load ends on a
        chunk boundary."""
        n, suffix = found - start, prompt_len - found
        with self._lock:
            self._drain()
            ahead_link = int(self._backlog)
            ahead_cpu = sum(t for r, t in self._prefill.items() if r != rid)
            fit, rate, running = self.steps.fit(), self.rate, self.running
        measured = fit is not None and rate is not None
        a, b = fit if measured else (0.0, 1.0)  # not both measured: equal rates, the queues decide
        r = rate if measured else 1.0

        v = self.predraft_value or 0.0
        cap = (max_new - 1) * (a + b) if max_new else float("inf")

        def link(x: int) -> float:  # when a load of x tokens is in
            return (ahead_link + x) / r if x > 0 else 0.0

        def ready(x: int) -> float:  # when the request's KV is ready
            return max(link(x), ahead_cpu * b) + (n - x + suffix) * b + a

        def t(x: int) -> float:  # ... less what pre-drafting during the load saves later
            return ready(x) - (min(v * max(0.0, link(x) - ahead_cpu * b), cap) if x > 0 else 0.0)

        options = [0] + [e - start for e in range(self.chunk, found + 1, self.chunk) if e > start]
        if measured:  # a cache never makes the first token slower than no cache (within TTFT_SLACK)
            options = [x for x in options if x == 0 or ready(x) <= (1 + TTFT_SLACK) * ready(0)]
        # what this request computes, every running request waits for (measured rates only: else the queues decide)
        times = {x: t(x) + (running * (n - x) * b if measured else 0.0) for x in options}
        best = min(times.values())
        load = max(x for x in options if times[x] <= best + TIE * abs(best) + 1e-12)
        est = t if measured else (lambda x: None)
        return Plan(
            load,
            n,
            est(load),
            est(n),
            est(0),
            rate,
            None if fit is None else 1.0 / fit[1],
            ahead_link,
            ahead_cpu,
            self.predraft_value,
            ready(load) if measured else None,
            running,
        )


class LinkMeter:
    """The worker's side: rate samples of its loads, each whole in itself: the bytes received over the seconds
    at least one load was in flight, closed once SPELL_S of loading has added up (at the bytes that complete
    it) or when the last load in flight ends (a short spell is a sample too). The scheduler side gets only
    closed samples, so whatever it misses or gets late loses whole samples, never part of one (a sample it
    pieced together from each step's bytes and seconds once read a 0.1 Gbit/s link as 6,689 tokens/s, 25x
    its rate: results/vllm_bench/20261206-104413, r0-c1-0.1gbit-connector)."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self._lock = threading.Lock()
        self._active, self._since = 0, 0.0  # loads in flight; when the open sample's current busy stretch began
        self._bytes, self._busy = 0, 0.0  # the open sample: bytes, busy seconds before `_since`
        self._closed = (0, 0.0)  # closed samples not yet taken: bytes, seconds

    def begin(self) -> None:
        with self._lock:
            if self._active == 0:
                self._since = self.clock()
            self._active += 1

    def end(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                self._busy += self.clock() - self._since
                self._close()

    def moved(self, nbytes: int) -> None:
        with self._lock:
            self._bytes += nbytes
            now = self.clock()
            if self._active and self._busy + (now - self._since) >= SPELL_S:
                self._busy += now - self._since
                self._since = now
                self._close()

    def _close(self) -> None:
        if self._bytes > 0 and self._busy > 0:  # (a spell that moved nothing, e.g. a failed load: no sample)
            self._closed = (self._closed[0] + self._bytes, self._closed[1] + self._busy)
        self._bytes, self._busy = 0, 0.0

    def take(self) -> tuple[int, float]:
        """(bytes, seconds) of the samples closed since the last take; (0, 0.0) if none."""
        with self._lock:
            out, self._closed = self._closed, (0, 0.0)
            return out
