"""How many self-drafts the rows drafting on their own views get, and what vLLM accepted of them.

ViewPacer. The rows that draft on their views draft TOGETHER: one batched draft step gives each of them a token
(view_draft.py), so its cost t_d(R) is shared by the R rows, unlike drafts made for one request alone
(DraftPacer.horizon). With x drafts each, a vLLM step over B requests emits B - R + sum_r E(a_r, x) tokens
(E as in pacing.py: the tokens a row emits at per-draft acceptance a_r) in t_v(B) + x t_d(R) + c R x seconds
(x draft steps, then each draft one more row of the verify forward). One x for all of them: the best, proposed
only if that rate beats plain decoding's B / t_v(B) by MARGIN; each row then gets at most its own room.
t_d(R) is measured per number of rows (a line through the sizes seen for sizes not seen); until MEASURE_STEPS
steps are, each proposal is one draft (its step measures it). The BatchSwitch (pacing.py) still decides, measured, whether drafting raises vLLM's
output at this batch size at all.

ViewRows. Per request (vLLM's request id: the runner knows which request each row is), its acceptance estimate
of view drafts and its last proposal: how far its row followed the drafts is what vLLM accepted.
"""

from __future__ import annotations

import collections
import statistics

from ....engine.planner import AcceptanceEstimate, expected_tokens
from .chains import common
from .pacing import MARGIN, SAMPLES, DraftPacer, by_size, new_estimate

MEASURE_STEPS = 3  # view draft steps measured (one draft each) before their cost decides


class ViewPacer:
    def __init__(self, pacer: DraftPacer):
        self.pacer = pacer
        self._steps: dict[int, collections.deque] = {}  # rows -> seconds of one batched view draft step

    def drafted(self, seconds: float, rows: int) -> None:
        """One batched view draft step over `rows` rows took `seconds`."""
        self._steps.setdefault(rows, collections.deque(maxlen=SAMPLES)).append(seconds)

    def step_s(self, rows: int) -> float | None:
        return by_size(self._steps, rows)

    def horizon(self, alphas: list[float], room: int, batch: int) -> int:
        """Drafts for each of the len(alphas) rows drafting on their views in a batch of `batch` requests (0:
        none). Before vLLM's step at this batch is measured: none; before a view draft step is: one."""
        t_v, rows = self.pacer.step_s(batch), len(alphas)
        room = min(room, self.pacer.k_max)
        if t_v is None or rows == 0 or room < 1:
            return 0
        if sum(len(d) for d in self._steps.values()) < MEASURE_STEPS:
            return 1  # measuring: a first draft step also pays for warm-ups, one sample is not the cost
        t_d = self.step_s(rows)
        c, plain = self.pacer.per_draft_s, batch / t_v
        best_x, best_rate = 0, plain
        for x in range(1, room + 1):
            rate = (batch - rows + sum(expected_tokens(a, x) for a in alphas)) / (t_v + x * t_d + c * rows * x)
            if rate > best_rate:
                best_x, best_rate = x, rate
        return best_x if best_x and best_rate > (1 + MARGIN) * plain else 0

    def describe(self) -> str:
        steps = ", ".join(f"{r}: {statistics.median(d) * 1000:.1f}" for r, d in sorted(self._steps.items()) if d)
        return f"view draft steps by rows (ms) {{{steps}}}"


class ViewRows:
    def __init__(self):
        self._estimates: dict[str, AcceptanceEstimate] = {}
        self._proposed: dict[str, tuple[int, list[int]]] = {}  # request id -> (row length, drafts) last step

    def estimate(self, rid: str) -> AcceptanceEstimate:
        return self._estimates.setdefault(rid, new_estimate())

    def account(self, rid: str, row: list[int]) -> int:
        """The view drafts vLLM accepted of this request's last proposal (0 if none was made or the step did not
        run it), folded into its estimate."""
        got = self._proposed.pop(rid, None)
        if got is None or len(row) <= got[0]:
            return 0
        at, drafts = got
        n = common(drafts, row[at:], 0)
        self.estimate(rid).update(n, len(drafts))
        return n

    def proposed(self, rid: str, at: int, drafts: list[int]) -> None:
        if drafts:
            self._proposed[rid] = (at, list(drafts))

    def keep(self, rids: set[str]) -> None:
        """Forget the requests no longer running (finished or preempted)."""
        for rid in [r for r in self._estimates if r not in rids]:
            del self._estimates[rid]
            self._proposed.pop(rid, None)
