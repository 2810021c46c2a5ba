"""The guard: is VeriCache beating full KV on this engine while it serves? Measured, not predicted.

While VeriCache rows run, the engine hands the guard each step it decodes in (ServingEngine._packed_step: its
seconds, link waits included, the tokens it emitted, its verifications) and each idle wait for a reload. The
guard's VeriCache rate is those tokens, plus the drafts in flight each row is expected to get accepted (its own
acceptance: expected_tokens(a, drafts) - 1), over those seconds; prefills are left out on both sides (full KV
prefills the same prompts). The full-KV rate it is held against is the capacity model's for the requests at hand
(its full-KV side is the roofline calibrated on a full-KV run: within ~1% of what such runs measure), else what
steps whose rows were all on full KV measured (rows / second).

VeriCache loses when its rate is below the full-KV rate, once every VeriCache row has verified and there are at
least two verifications a row behind the figure, and only where moving pays: the tokens left to the VeriCache rows
take longer at its rate than at full KV's plus the reloads that moving them costs (each row's prompt once over the
link). Then the scheduler moves rows to full KV (Scheduler.fallback, moves.py) until no VeriCache row is left.
"""

from __future__ import annotations

from .planner import expected_tokens


class Guard:
    def __init__(self, margin: float = 0.0, rounds_per_row: int = 2):
        """margin: VeriCache must lose by more than this share of the full-KV rate."""
        self.margin, self.rounds_per_row = margin, rounds_per_row
        self.full_measured: float | None = None  # rows / s of steps with only full-KV rows (EMA)
        self.reset()

    def reset(self) -> None:
        """A new set of rows (nothing was running): measure afresh."""
        self.tokens, self.seconds, self.rounds = 0, 0.0, 0
        self.rate: float | None = None  # the last VeriCache rate computed

    def observe(self, seconds: float, tokens: int, rounds: int) -> None:
        """A step (or an idle wait for a reload) while VeriCache rows ran: its seconds, tokens emitted, verifications."""
        self.seconds += seconds
        self.tokens += tokens
        self.rounds += rounds

    def observe_full(self, rows: int, seconds: float) -> None:
        """A step whose rows were all on full KV: the full-KV rate measured."""
        if seconds > 0:
            rate = rows / seconds
            self.full_measured = rate if self.full_measured is None else 0.8 * self.full_measured + 0.2 * rate

    def loses(self, rows: list, full_rate: float | None, reload_s: float) -> bool:
        """rows: the VeriCache rows running (Sequence: alpha, drafts, drafted, remaining); full_rate: the full-KV
        tokens/s the model predicts (0: full KV cannot serve these rows; None: no model, the measured rate if any);
        reload_s: seconds a row's prompt takes over the link."""
        full_rate = self.full_measured if full_rate is None else full_rate
        if not rows or not full_rate or self.seconds <= 0:
            return False
        if any(not r.drafted for r in rows) or self.rounds < self.rounds_per_row * len(rows):
            return False
        pending = sum(expected_tokens(r.alpha or 0.0, len(r.drafts)) - 1 for r in rows)
        self.rate = (self.tokens + pending) / self.seconds
        if self.rate >= full_rate * (1 - self.margin):
            return False
        left = sum(r.remaining for r in rows)
        return left / self.rate > left / full_rate + len(rows) * reload_s
