"""The machine's load average around a run: on 2 shared cores a busy neighbour changes the ratios themselves, so
every results.json says how busy the machine was before the run and while it ran.

    with LoadAverage() as load:
        ...                                  # the run; kit.load.now() for a row's own figure
    doc["load_avg"] = load.record()          # {"before": [1, 5, 15 min], "during": {...}, "after": [...]}

"during" is the 1-minute figure sampled every `every_s` seconds by a daemon thread (and once at the end):
its mean, its maximum and how many samples. Nothing starts before __enter__.
"""

from __future__ import annotations

import os
import statistics
import threading


def now() -> float:
    """The 1-minute load average now."""
    return os.getloadavg()[0]


class LoadAverage:
    def __init__(self, every_s: float = 10.0):
        if not every_s > 0:
            raise ValueError(f"every_s must be > 0, got {every_s}")
        self.every_s = every_s
        self.before: tuple[float, float, float] | None = None
        self.after: tuple[float, float, float] | None = None
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "LoadAverage":
        self.before = os.getloadavg()
        self._thread = threading.Thread(target=self._sample, name="load-average", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.every_s):
            self.samples.append(now())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.after = os.getloadavg()
        self.samples.append(self.after[0])

    def record(self) -> dict:
        """{"before", "during": {"mean", "max", "samples"}, "after"} (None where not measured yet)."""
        during = None
        if self.samples:
            during = {"mean": statistics.fmean(self.samples), "max": max(self.samples), "samples": len(self.samples)}
        return {"before": self.before, "during": during, "after": self.after}

    def describe(self) -> str:
        """'Load average B before, M during (max X)': for a table's header."""
        rec = self.record()
        before = "-" if rec["before"] is None else f"{rec['before'][0]:.2f}"
        during = rec["during"]
        if during is None:
            return f"Load average {before} before"
        return f"Load average {before} before, {during['mean']:.2f} during (max {during['max']:.2f})"
