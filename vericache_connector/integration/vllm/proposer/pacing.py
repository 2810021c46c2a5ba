"""When the proposer drafts, and how its drafting shares the worker with vLLM's own forward.

TargetGate. Draft steps run vLLM's own modules (draft_model.py): they must never overlap vLLM's forward (on
the CPU both would call the same oneDNN handles, and they would split the cores anyway). The served model's
forward is wrapped to enter the gate as "target"; every draft step enters as "draft". A waiting target goes
first: a draft step starts only when no target forward runs or waits, so a pre-draft on its own thread
delays a concurrent request's step by at most the one draft step in progress.

BatchSwitch. Whether drafting pays at a batch size is finally measured: tokens per second of vLLM's steps with
drafts against steps without (class docstring); the pacer below sizes the drafts where it does.

DraftPacer. A draft is worth its cost only if it raises the server's output: drafting for one request
lengthens the step every running request waits for. A vLLM step over B requests takes t_v(B) seconds and
emits B tokens without drafts; with x drafts for one of them (drafted in propose, t_d seconds a draft step,
before the step) at per-draft acceptance a it emits B - 1 + E(x), E(x) = (1 - a^(x+1)) / (1 - a), in
t_v(B) + x t_d + c x seconds (each draft adds a row to the verify forward). Draft x* drafts, the best x,
only if (B - 1 + E(x*)) / (t_v(B) + x* (t_d + c)) > (1 + MARGIN) B / t_v(B): otherwise none. One request
alone (B = 1) this is its own rate; at a large batch a draft must save about B times its cost, so drafting
stops where the batch already keeps the CPU busy. t_v(B) is measured per batch size (medians of steps
without drafts, a line through them for sizes not seen), t_d and c as the server runs, a per request from
what vLLM accepted of the previous proposal. Drafts that cost nothing more to make (pre-drafts made while
the KV loaded, n-gram matches) still cost c each to verify: x* = argmax (B - 1 + E(x)) / (t_v(B) + c x)
of them are proposed (none when even one does not pay).

The pre-draft itself has a price on a slow store link: the compressed copy crosses the link too, so the full
copy lands later by the compressed copy's transfer time T_c. worth_predraft fetches it only where the drafts
are expected to save more: (tokens vLLM accepted from pre-drafts per request, measured; at most the request's
max_tokens - 1) x t_v > (1 + MARGIN) T_c. With split16 the compressed copy is half of the full copy and
costs nothing on the link; the pre-draft then runs only where the rest of the load (about as long as the
compressed copy took) leaves room for WINDOW_STEPS draft steps: on a fast store its draft steps would only
take the cores from the load.

The connector's worker asks these questions (worth_predraft, predraft_value, worth_predraft_during,
drafts_could_pay) of one object, through the handoff (handoff.Pacing): while a proposer is attached,
ProposerPacing (handoff_pacing.py), the DraftPacer's answers for the drafts the proposer offers.
"""

from __future__ import annotations

import collections
import contextlib
import statistics
import threading
import time

from ....engine.planner import AcceptanceEstimate, expected_tokens

MARGIN = 0.05  # drafting must promise this much more throughput than plain decoding
ALPHA_PRIOR = 0.8  # per-draft acceptance before a request has been verified
YIELD_PRIOR = 8.0  # pre-drafted tokens vLLM accepts per request, before any was measured
# What one more draft adds to a vLLM step, as a fraction of the step, until measured: on the CPU a verify
# forward turns compute-bound within a few tokens (the weights' pass no longer dominates); on a GPU a few
# dozen tokens cost about what one does.
PER_DRAFT_PRIOR = {"cpu": 0.1, "cuda": 0.01}
FREE_DEFAULT = 8  # drafts already made proposed per step before vLLM's step time is measured
SAMPLES = 16  # step times kept per measurement (medians: a prefill or an idle gap is an outlier)
BUSY_GAP_S = 0.1  # a target forward ended this recently: more are coming (vLLM is serving requests)
WINDOW_STEPS = 3  # a pre-draft that costs no link time still needs room for this many draft steps


class TargetGate:
    def __init__(self):
        self._cond = threading.Condition()
        self._targets_waiting = 0
        self._target_running = False
        self._drafting = False
        self._target_ended = float("-inf")

    def target_busy(self) -> bool:
        """vLLM is computing, or has just been and will again soon: a pre-draft should wait."""
        with self._cond:
            recent = time.perf_counter() - self._target_ended < BUSY_GAP_S
            return self._target_running or self._targets_waiting > 0 or recent

    @contextlib.contextmanager
    def target(self):
        with self._cond:
            self._targets_waiting += 1
            self._cond.wait_for(lambda: not self._drafting)
            self._targets_waiting -= 1
            self._target_running = True
        try:
            yield
        finally:
            with self._cond:
                self._target_running = False
                self._target_ended = time.perf_counter()
                self._cond.notify_all()

    @contextlib.contextmanager
    def draft(self):
        with self._cond:
            self._cond.wait_for(lambda: not (self._drafting or self._target_running or self._targets_waiting))
            self._drafting = True
        try:
            yield
        finally:
            with self._cond:
                self._drafting = False
                self._cond.notify_all()

    def wrap(self, forward):
        """forward, entering the gate as the target."""

        def gated(*args, **kwargs):
            with self.target():
                return forward(*args, **kwargs)

        return gated


class DraftPacer:
    def __init__(self, k_max: int, device: str = "cpu"):
        self.k_max = k_max
        self.on_device(device)
        self._draft = collections.deque(maxlen=SAMPLES)  # one batched single-token draft step
        self._plain: dict[int, collections.deque] = {}  # batch rows -> vLLM steps with no drafts to verify
        self._per_draft = collections.deque(maxlen=SAMPLES)  # (drafts, what they added to their step)
        self._last: tuple[float, int, int] | None = None  # the previous propose: (its end, rows, drafts)
        self._yields = collections.deque(maxlen=SAMPLES)  # pre-drafted tokens accepted, per request
        self._predraft_s = collections.deque(maxlen=SAMPLES)  # (accepted, seconds pre-drafted), per request

    def on_device(self, device: str) -> None:
        """The drafts run on `device` ("cpu", "cuda"): what one more draft adds to a step, until measured."""
        self.per_draft_prior = PER_DRAFT_PRIOR.get(device, PER_DRAFT_PRIOR["cpu"])

    @property
    def draft_s(self) -> float | None:
        return statistics.median(self._draft) if self._draft else None

    def step_s(self, rows: int = 1) -> float | None:
        """t_v(rows): the median step measured at this batch size, else a line through the medians measured
        at other sizes (the nearest one's where only one was), else None."""
        return by_size(self._plain, rows)

    @property
    def per_draft_s(self) -> float:
        """c: measured once a few steps verified drafts (the seconds they added over the drafts they verified:
        what drafting costs the server, an occasional slow step included, which a median of per-step ratios
        leaves out; a step of one draft, its extra time mostly noise, weighs one draft), else the prior share
        of a step."""
        if len(self._per_draft) >= 3:
            return max(0.0, sum(e for _, e in self._per_draft) / sum(x for x, _ in self._per_draft))
        return self.per_draft_prior * (self.step_s() or 0.0)

    # ---- measurements ----
    def record_step(self, seconds: float, rows: int = 1, drafts: int = 0) -> None:
        """A vLLM step over `rows` requests verifying `drafts` drafts took `seconds`."""
        if drafts == 0:
            self._plain.setdefault(rows, collections.deque(maxlen=SAMPLES)).append(seconds)
        elif (t_v := self.step_s(rows)) is not None:
            self._per_draft.append((drafts, seconds - t_v))

    def propose_started(self, now: float | None = None, prefill: bool = False) -> None:
        """vLLM's step ran between the end of the previous propose and now (prefill: it also computed a new
        request's prompt, an outlier left out)."""
        now = time.perf_counter() if now is None else now
        if self._last is not None and not prefill:
            end, rows, drafts = self._last
            self.record_step(now - end, rows, drafts)
        self._last = None

    def propose_ended(self, drafts_proposed: int, now: float | None = None, rows: int = 1) -> None:
        self._last = (time.perf_counter() if now is None else now, rows, drafts_proposed)

    def drafted(self, seconds: float) -> None:
        self._draft.append(seconds)

    def predraft_yield(self, accepted: int, seconds: float | None = None) -> None:
        """A request that had pre-drafts finished: vLLM accepted `accepted` of them, made over `seconds`."""
        self._yields.append(accepted)
        if seconds is not None and seconds > 0:
            self._predraft_s.append((accepted, seconds))

    def predraft_value(self) -> float | None:
        """Decode seconds the pre-drafts saved per second spent pre-drafting: accepted tokens x t_v(1) over
        the pre-drafts' seconds, over recent requests (None until one finished)."""
        t_v = self.step_s(1)
        if not self._predraft_s or t_v is None:
            return None
        return sum(a for a, _ in self._predraft_s) * t_v / sum(s for _, s in self._predraft_s)

    def describe(self) -> str:
        f = [(n, v) for n, v in (("draft", self.draft_s), ("step", self.step_s())) if v is not None]
        steps = ", ".join(f"{b}: {statistics.median(d) * 1000:.0f}" for b, d in sorted(self._plain.items()) if d)
        return (
            ", ".join(f"{n} {v * 1000:.1f} ms" for n, v in f)
            + f", +{self.per_draft_s * 1000:.1f} ms/draft, steps by batch (ms) {{{steps}}}"
        )

    # ---- the decisions ----
    def horizon(self, est: AcceptanceEstimate, room: int, batch: int = 1) -> int:
        """Compressed-KV drafts worth drafting now for a request with acceptance estimate `est` in a batch of
        `batch` running requests (0: propose nothing). Before vLLM's step is measured: none; before a draft
        step is: one (the measurement), where one alone would not be off already."""
        t_v, t_d = self.step_s(batch), self.draft_s
        if t_v is None or room < 1:
            return 0
        if t_d is None:
            return 1 if batch == 1 else 0
        return self._best(est.alpha, min(self.k_max, room), batch, t_v, t_d + self.per_draft_s)

    def free_horizon(self, est: AcceptanceEstimate, room: int, batch: int = 1) -> int:
        """How many of the drafts already made (pre-drafts, an n-gram match) to propose: each costs only its
        row in the verify forward."""
        t_v, c = self.step_s(batch), self.per_draft_s
        room = min(self.k_max, room)
        if t_v is None or c <= 0:
            return min(room, FREE_DEFAULT)
        return self._best(est.alpha, room, batch, t_v, c)

    @staticmethod
    def _best(alpha: float, room: int, batch: int, t_v: float, per_draft: float) -> int:
        """argmax over x of the batch's rate (batch - 1 + E(x)) / (t_v + x per_draft); 0 unless it beats
        plain decoding (batch / t_v) by MARGIN."""
        best_x, best_rate = 0, batch / t_v
        for x in range(1, room + 1):
            rate = (batch - 1 + expected_tokens(alpha, x)) / (t_v + per_draft * x)
            if rate > best_rate:
                best_x, best_rate = x, rate
        return best_x if best_x and best_rate > (1 + MARGIN) * batch / t_v else 0

    def worth_predraft_during(self, seconds: float) -> bool:
        """Pre-draft while the rest of the KV arrives in about `seconds` (no link cost: split16)?"""
        t = self.draft_s or self.step_s()
        return t is None or seconds > WINDOW_STEPS * t

    def worth_predraft(self, compressed_s: float | None, max_new: int | None) -> bool:
        """Fetch the compressed copy for pre-drafts? compressed_s: its expected transfer time (None: unknown)."""
        t_v = self.step_s()
        if compressed_s is None or t_v is None:
            return True  # not measured yet: fetch, and learn what it costs and saves
        tokens = statistics.median(self._yields) if self._yields else YIELD_PRIOR
        if max_new is not None:
            tokens = min(tokens, max_new - 1)
        return tokens * t_v > (1 + MARGIN) * compressed_s


class BatchSwitch:
    """Does proposing drafts raise vLLM's output at this batch size? Measured, not predicted: the pacer's model
    leaves out what a draft costs beyond its row (vLLM's speculative path, the proposer's own work, prefills
    crowded out of a step), which under load is most of it. Per batch bucket (1, 2, 3-4, 5-8, 9-16, 17+): the
    tokens vLLM's steps emitted per second in steps with drafts and in steps without (a step whose batch
    changed, or that ran a new request's prefill, left out). Drafting is on in a bucket while its rate beats
    the rate without by MARGIN (on until both are measured); a run of EXPLORE_RUN steps of the other arm
    every EXPLORE_EVERY steps keeps both measured."""

    BUCKETS = (1, 2, 4, 8, 16)
    WINDOW = 48  # steps kept per arm and bucket
    MIN_STEPS = 8  # per arm, before the rates decide
    EXPLORE_EVERY, EXPLORE_RUN = 32, 4

    def __init__(self):
        self._steps: dict[tuple[int, bool], collections.deque] = {}
        self._tick: dict[int, int] = {}

    def bucket(self, rows: int) -> int:
        return next((i for i, b in enumerate(self.BUCKETS) if rows <= b), len(self.BUCKETS))

    def record(self, rows: int, drafted: bool, emitted: int, seconds: float) -> None:
        if seconds > 0 and emitted >= 0:
            key = (self.bucket(rows), drafted)
            self._steps.setdefault(key, collections.deque(maxlen=self.WINDOW)).append((emitted, seconds))

    def rate(self, rows: int, drafted: bool) -> float | None:
        got = self._steps.get((self.bucket(rows), drafted))
        if not got or len(got) < self.MIN_STEPS:
            return None
        return sum(e for e, _ in got) / sum(s for _, s in got)

    def pays(self, rows: int) -> bool | None:
        """Measured: drafting raises the output at this batch size (None: not both arms measured yet)."""
        on, off = self.rate(rows, True), self.rate(rows, False)
        return None if on is None or off is None else on > (1 + MARGIN) * off

    def allows(self, rows: int) -> bool:
        """Whether this step proposes drafts (one call per step): the winning arm, with exploration runs of
        the other; while unmeasured, runs of EXPLORE_RUN steps alternate."""
        b = self.bucket(rows)
        tick = self._tick[b] = self._tick.get(b, -1) + 1
        pays = self.pays(rows)
        if pays is None:
            return (tick // self.EXPLORE_RUN) % 2 == 0
        explore = tick % self.EXPLORE_EVERY < self.EXPLORE_RUN
        return pays != explore

    def describe(self) -> str:
        out = []
        for i, b in enumerate((*self.BUCKETS, "more")):
            rows = b if isinstance(b, int) else self.BUCKETS[-1] + 1
            on, off = self.rate(rows, True), self.rate(rows, False)
            if on is not None or off is not None:
                f = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
                out.append(f"<={b}: {f(on)} / {f(off)} tok/s")
        return "drafts on / off by batch " + (", ".join(out) or "unmeasured")


def by_size(samples: dict[int, collections.deque], size: int) -> float | None:
    """A time at `size` (a batch's rows) from samples by size: the median at that size once it has 3 samples
    (or is the only size seen), else a line through the medians of the sizes seen (never below the fastest
    one, never falling with size), else None."""
    seen = {b: statistics.median(d) for b, d in samples.items() if d}
    if len(samples.get(size) or ()) >= 3 or (size in seen and len(seen) == 1):
        return seen[size]
    if not seen:
        return None
    if len(seen) == 1:
        ((_, t),) = seen.items()
        return t
    n = len(seen)
    mb, mt = sum(seen) / n, sum(seen.values()) / n
    sbb = sum((b - mb) ** 2 for b in seen)
    slope = sum((b - mb) * (t - mt) for b, t in seen.items()) / sbb if sbb else 0.0
    return max(min(seen.values()), mt + max(0.0, slope) * (size - mb))


def new_estimate() -> AcceptanceEstimate:
    return AcceptanceEstimate(ALPHA_PRIOR)
