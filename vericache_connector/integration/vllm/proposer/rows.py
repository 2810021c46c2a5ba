"""Which running request each of vLLM's rows is, from one propose to the next.

vLLM hands a custom proposer every running request's tokens (prompt + output so far) by batch index, with no
request id. The proposer needs to know which rows continue the previous step's requests: a new row means a
prefill ran in the step (an outlier for the step-time measurements), and a request's drafts of the last step
are scored against that same request's row. A hash of a row's first tokens does not tell requests apart:
requests on one stored document, or behind one system prompt, share their first thousands of tokens. A row
continues a request of the previous step when that request's whole previous row is its prefix: vLLM keeps a
request at its index (the same index is tried first) and moves it only when it condenses the batch after
another request finished.
"""

from __future__ import annotations

import numpy as np


def continues(row: np.ndarray, prev: np.ndarray) -> bool:
    """row is prev grown by this step's tokens (or prev itself: a request that did not run)."""
    return len(prev) <= len(row) and np.array_equal(row[: len(prev)], prev)


class RowTracker:
    def __init__(self):
        self._prev: dict[int, np.ndarray] = {}  # batch index -> its row at the previous propose (a copy)
        self.left = 0  # requests of the previous propose that this one no longer has (finished, preempted)

    def match(self, rows: dict[int, np.ndarray]) -> dict[int, int | None]:
        """For each batch index of this propose: the index its request had at the previous one (None: a
        request new to the batch). Each previous request continues in at most one row."""
        free = dict(self._prev)
        out: dict[int, int | None] = {}
        for i, row in rows.items():
            if i in free and continues(row, free[i]):
                p = i
            else:
                p = next((j for j, prev in free.items() if continues(row, prev)), None)
            if p is not None:
                del free[p]
            out[i] = p
        self.left = len(free)
        self._prev = {i: np.array(row, copy=True) for i, row in rows.items()}
        return out

    def same_batch(self, matched: dict[int, int | None]) -> bool:
        """The step between the last two proposes ran the same requests (none new, none gone)."""
        return self.left == 0 and all(p is not None for p in matched.values())
