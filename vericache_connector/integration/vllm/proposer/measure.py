"""What the proposer measures as vLLM runs, for its own decisions and for the connector's metrics.

Acceptance. A row's growth since the last propose tells how many of the drafts proposed for it vLLM accepted
(greedy or not, the drafts it kept are a prefix of what it emitted). Counted by source: a request's pre-drafts
and compressed-KV drafts update its own estimate (Group.estimate; the pre-drafts also what its fetch earned,
DraftPacer.predraft_yield), n-gram drafts the estimate of their match's length (on greedy outputs a 4-token
match's drafts are right far more often than a 2-token match's: benchmarks/ngram_replay.py). The pacer sizes
each proposal by the estimate of its kind.

StepMeter. The step vLLM ran between two proposes: its seconds for the DraftPacer (by the drafts it verified,
a prefill's step left out), and the tokens it emitted per second, with drafts or without, for the
BatchSwitch (left out where the batch changed); an INFO line whenever the switch's verdict for a batch
bucket changes.

The counters (new_stats, Acceptance.accepted) only grow: connector/stats.py reads the proposer's "predrafted"
and "drafted" and its tokens accepted by source into the connector's metrics every step.
"""

from __future__ import annotations

import time

from vllm.logger import init_logger

from .chains import Group, common
from .pacing import BatchSwitch, DraftPacer, new_estimate

logger = init_logger("vllm.vericache")

SOURCES = ("predraft", "compressed", "ngram")  # where the proposer got a draft


def new_stats() -> dict[str, int]:
    """The proposer's counters: proposals, pre-drafts started / tokens pre-drafted / branches / proposals
    from them, n-gram proposals, tokens drafted after the load, rows paced off, rows whose view would hold
    most of their KV (view.ViewPolicy.max_share), seeded or switched off."""
    return dict.fromkeys(
        (
            "proposals",
            "predrafts",
            "predrafted",
            "branches",
            "predrafts_used",
            "ngram",
            "drafted",
            "paced_off",
            "view_too_short",
            "seeded",
            "switched_off",
        ),
        0,
    )


class Acceptance:
    def __init__(self, ngram: tuple[int, int]):
        self.accepted = dict.fromkeys(SOURCES, 0)  # tokens vLLM accepted (connector/stats.py)
        # acceptance of n-gram drafts by the length of the match behind them, all requests
        self.ngram_est = {n: new_estimate() for n in range(ngram[0], ngram[1] + 1)}
        self.ngram_last: dict[int, tuple[int, list[int], int]] = {}  # batch index -> this step's n-gram drafts

    def new_step(self) -> dict[int, tuple[int, list[int], int]]:
        """The n-gram drafts proposed at the last step, by batch index (this step's start empty)."""
        last, self.ngram_last = self.ngram_last, {}
        return last

    def group(self, group: Group, row: list[int]) -> None:
        """Acceptance of the compressed drafts proposed last step: how far the row followed them."""
        if group.proposed is None:
            return
        at, drafts, source = group.proposed
        group.proposed = None
        if len(row) > at:  # the step ran: n of the drafts accepted
            n = common(drafts, row[at:], 0)
            group.estimate.update(n, len(drafts))
            self.accepted[source] += n
            if source == "predraft":
                group.predraft_accepted += n

    def ngram(self, row: list[int], got: tuple[int, list[int], int] | None) -> None:
        """Acceptance of the n-gram drafts proposed for this request last step (got: where, what, and the
        length of the match behind them)."""
        if got is not None and len(row) > got[0]:
            at, drafts, n_gram = got
            n = common(drafts, row[at:], 0)
            self.ngram_est[n_gram].update(n, len(drafts))
            self.accepted["ngram"] += n


class StepMeter:
    def __init__(self, pacer: DraftPacer, switch: BatchSwitch):
        self.pacer, self.switch = pacer, switch
        self._end: tuple[int, bool, float] | None = None  # the last propose: (batch tokens, drafted, end)
        self._said: dict[int, bool | None] = {}  # batch bucket -> what the switch last measured

    def started(self, prefill: bool, same_batch: bool, batch: int, total: int) -> None:
        """The step vLLM just ran (prefill: it computed a prompt too): for the pacer its time; for the switch
        the tokens it emitted (the rows' growth: `total` is the batch's tokens now) over its seconds, with or
        without drafts, left out where the batch changed (same_batch False)."""
        self.pacer.propose_started(prefill=prefill)
        if self._end is not None and same_batch:
            last_total, drafted, end = self._end
            self.switch.record(batch, drafted, total - last_total, time.perf_counter() - end)
        self._end = None

    def allows(self, batch: int) -> bool:
        """Whether this step proposes drafts (BatchSwitch.allows; one call per step), logging a new verdict."""
        allowed = self.switch.allows(batch)  # measured: do drafts raise the output at this batch size?
        bucket, pays = self.switch.bucket(batch), self.switch.pays(batch)
        if self._said.get(bucket) != pays:
            self._said[bucket] = pays
            if pays is not None:
                logger.info(
                    "VeriCache proposer: drafts %s at batch %d; %s",
                    "on" if pays else "off",
                    batch,
                    self.switch.describe(),
                )
        return allowed

    def ended(self, drafts: int, batch: int, total: int) -> None:
        """This propose offers `drafts` drafts over `batch` rows of `total` tokens: vLLM's step starts."""
        self.pacer.propose_ended(drafts, rows=batch)
        self._end = (total, drafts > 0, time.perf_counter())
