"""The machine's load average around a run: on 2 shared cores a busy neighbour changes the ratios themselves, so
every results.json says how busy the machine was before the run and while it ran.

    load = LoadAverage().start()             # or: with LoadAverage() as load: ...
    ...                                      # the run; kit.load.now() for a row's own figure
    doc["load_avg"] = load.stop()            # {"before": [1, 5, 15 min], "during": {...}, "after": [...]}

"during" is the 1-minute figure sampled every `every_s` seconds by a daemon thread (and once at the end): its
mean, its maximum and how many samples. Nothing starts before start().
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

    def start(self) -> "LoadAverage":
        self.before = os.getloadavg()
        self._thread = threading.Thread(target=self._sample, name="load-average", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.every_s):
            self.samples.append(now())

    def stop(self) -> dict:
        """Stops the sampling (once; later calls change nothing); the record."""
        if self._thread is not None and not self._stop.is_set():
            self._stop.set()
            self._thread.join()
            self.after = os.getloadavg()
            self.samples.append(self.after[0])
        return self.record()

    def __enter__(self) -> "LoadAverage":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def record(self) -> dict:
        """{"before", "during": {"mean", "max", "samples"}, "after"}: so far while it runs (after: None)."""
        samples = list(self.samples)
        during = None
        if samples:
            during = {"mean": statistics.fmean(samples), "max": max(samples), "samples": len(samples)}
        return {"before": self.before, "during": during, "after": self.after}


def describe(record: dict) -> str:
    """'Load average B before, M during (max X), A after' from a record (older results: before and after only)."""
    parts = []
    if record.get("before"):
        parts.append(f"{record['before'][0]:.2f} before")
    if record.get("during"):
        parts.append(f"{record['during']['mean']:.2f} during (max {record['during']['max']:.2f})")
    if record.get("after"):
        parts.append(f"{record['after'][0]:.2f} after")
    return "Load average " + (", ".join(parts) or "not measured")
