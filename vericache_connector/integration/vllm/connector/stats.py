"""The connector's metrics, through vLLM's own connector-stats path: `vericache_*` series on a vLLM server's /metrics.

Both halves count into a StatsRecorder (thread-safe: the store loop, the proposer's threads and vLLM's step all
count). vLLM drains them every step through `get_kv_connector_stats()`: the worker half's ride the step's
ModelRunnerOutput to the scheduler process (summed over workers with VeriCacheStats.aggregate), where vLLM's
Scheduler.update_from_output adds the scheduler half's own (it calls the scheduler-side connector's
`get_kv_connector_stats()` too), and the sum goes as a plain dict (`to_dict()`) in the step's SchedulerStats to the
API server process. There vLLM's PrometheusStatLogger hands it to the VeriCachePromMetrics that
`VeriCacheConnector.build_prom_metrics` made, which adds it to prometheus_client counters and histograms labelled
with vLLM's own model_name and engine; its LoggingStatLogger rebuilds it (`build_kv_connector_stats`) and logs
`reduce()` as "KV Transfer metrics: ...". Counts reach /metrics with the step after the one they happened in
(a save that ends while the server is idle shows with the next request's first step). Without vLLM's stats
(`--disable-log-stats`) there are none. Inside vLLM's MultiConnector the same dict rides under our class name.

What is counted where (docs/operations.md#metrics has every series and its meaning):
  scheduler.py  lookups, full-copy hits and misses (one per request: the lookup of its stored prefix), the reason
                of a miss (read off the store on its loop, after the decision: never on vLLM's step),
                load-or-recompute decisions (load_plan.py; not with "load_policy": "always"), lookup errors
  worker.py     saves, bytes written per copy; its loads (loads.py, split_load.py): bytes read per copy, load
                seconds, failed loads by reason, compressed-copy hits and misses; store errors of loads, fetches
                and saves
  proposer.py   pre-drafted and drafted tokens, tokens vLLM accepted per source (read by the worker half each step)
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from storage_backends import CorruptObject, MissingObject
from storage_backends.keys import FULL
from storage_backends.manifest import Manifest, UnauthenticatedObject

PREFIX = "vericache_"
COPIES = ("full", "compressed")
# why a copy was not there to use: nothing under its key; a manifest of another model/dtype under it; one that does
# not parse, fails its checksum or does not fit; one without the MAC this store expects (or with one, and this
# reader has no key); the other copy of the prefix is stored but not this one; the store did not answer
REASONS = ("absent", "another_model", "corrupt", "unauthenticated", "lone_copy", "store_down")
DECISIONS = ("load", "partial", "recompute")
SOURCES = ("predraft", "compressed", "ngram")
OPS = ("lookup", "load", "fetch_compressed", "save")
LOAD_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
MAX_OBSERVATIONS = 4096  # per histogram between two drains (a drain per vLLM step: never reached in practice)


@dataclass(frozen=True)
class Series:
    kind: str  # counter | histogram
    labels: tuple[str, ...]
    values: tuple[tuple[str, ...], ...]  # label values shown (as 0) from the start
    doc: str
    buckets: tuple[float, ...] = ()


def _all(*sets: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    out: list[tuple[str, ...]] = [()]
    for s in sets:
        out = [o + (v,) for o in out for v in s]
    return tuple(out)


SERIES: dict[str, Series] = {
    "lookups": Series("counter", (), ((),), "Requests whose stored prefix the connector looked up in the store."),
    "hits": Series(
        "counter",
        ("copy",),
        _all(COPIES),
        "Copies found. full: a lookup found the prefix's first chunk at least (once per request); compressed: a "
        "compressed copy fetched and checked (for the proposer).",
    ),
    "misses": Series(
        "counter",
        ("copy", "reason"),
        _all(COPIES, REASONS),
        "Copies not found, by reason. full: a lookup found no chunk (lookups = full hits + full misses); "
        "compressed: a fetch that brought no usable copy.",
    ),
    "bytes_read": Series(
        "counter",
        ("copy",),
        _all(COPIES),
        "KV bytes read from the store per copy (split16's lower halves: compressed).",
    ),
    "bytes_written": Series(
        "counter",
        ("copy",),
        _all(COPIES),
        "Bytes written to the store per copy (payloads; chunks already there: none).",
    ),
    "saves": Series("counter", (), ((),), "Prefixes written to the store (full + compressed copies)."),
    "load_seconds": Series(
        "histogram", (), ((),), "Seconds from a load's start to its full copy in vLLM's blocks.", LOAD_BUCKETS
    ),
    "load_failures": Series(
        "counter", ("reason",), _all(REASONS[:4] + REASONS[5:]), "Loads that failed after a hit (vLLM recomputes)."
    ),
    "load_decisions": Series(
        "counter",
        ("decision",),
        _all(DECISIONS),
        "Load-or-recompute decisions on a hit (load_plan.py): all of the stored prefix loaded, a leading part, none.",
    ),
    "predrafted_tokens": Series(
        "counter", (), ((),), "Tokens the proposer drafted on a compressed copy while the full copy loaded."
    ),
    "drafted_tokens": Series(
        "counter", (), ((),), "Tokens the proposer drafted on a compressed copy once the request ran (paced)."
    ),
    "accepted_tokens": Series(
        "counter", ("source",), _all(SOURCES), "Proposed tokens vLLM accepted, by where the proposer got them."
    ),
    "store_errors": Series(
        "counter",
        ("op",),
        _all(OPS),
        "Store operations that failed for the store's sake (down, timed out, a failed write), by operation.",
    ),
    "store_marked_down": Series(
        "counter", (), ((),), "Times a lookup failed or timed out and the store was marked down (breaker.py)."
    ),
    "lookups_skipped": Series(
        "counter", (), ((),), "Requests not looked up because the store was marked down (computed at once)."
    ),
}

_FOREIGN = re.compile(r"manifest .* is for \S+, not \S+")  # DualCopyStore._parse: another model's manifest


def miss_reason(e: BaseException) -> str:
    """The REASONS entry of an error a read of a copy raised."""
    if isinstance(e, UnauthenticatedObject):
        return "unauthenticated"
    if isinstance(e, CorruptObject):
        return "another_model" if _FOREIGN.search(str(e)) else "corrupt"
    if isinstance(e, MissingObject):
        return "absent"
    if isinstance(e, ValueError):  # a copy that does not fit the model or its own meta (Compressor.validate)
        return "corrupt"
    return "store_down"  # StoreUnavailable, a timeout, a dropped connection


async def full_miss_reason(store, prefix: list[int], spec: str) -> str:
    """Why a lookup found no chunk of `prefix` (its first chunk's manifest, read again): absent, lone_copy (the
    compressed copy `spec` of the prefix is there), another_model, unauthenticated or corrupt."""
    chunk = store.keys.chunks(prefix)[0]
    key = chunk.copy(FULL)
    raw = await store.backend.get(key)
    if raw is None:
        other = await store.backend.get(store.keys.prefix_key(prefix).copy(spec))
        return "absent" if other is None else "lone_copy"
    try:
        m = Manifest.from_bytes(raw, key, getattr(store, "_mac", None))
        if (m.model, m.dtype) != (store.keys.model_name, store.keys.dtype_name):
            return "another_model"
        store._check_full(chunk, key, raw)
    except CorruptObject as e:
        return miss_reason(e)
    return "absent"  # there now: written since the lookup


@dataclass
class VeriCacheStats(KVConnectorStats):
    """data = {"counters": {name: {"label|values": n}}, "observations": {name: [seconds, ...]}} (plain, msgpack-able:
    it crosses from the engine core to the API server)."""

    def __post_init__(self):
        if not self.data:
            self.reset()
        self.data.setdefault("counters", {})
        self.data.setdefault("observations", {})

    def reset(self):
        self.data = {"counters": {}, "observations": {}}

    def count(self, name: str, *labels: str, n: float = 1) -> None:
        by = self.data["counters"].setdefault(name, {})
        key = "|".join(labels)
        by[key] = by.get(key, 0) + n

    def observe(self, name: str, value: float) -> None:
        values = self.data["observations"].setdefault(name, [])
        if len(values) < MAX_OBSERVATIONS:
            values.append(value)

    def get(self, name: str, *labels: str) -> float:
        return self.data["counters"].get(name, {}).get("|".join(labels), 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, by in other.data.get("counters", {}).items():
            for key, n in by.items():
                mine = self.data["counters"].setdefault(name, {})
                mine[key] = mine.get(key, 0) + n
        for name, values in other.data.get("observations", {}).items():
            self.data["observations"].setdefault(name, []).extend(values[:MAX_OBSERVATIONS])
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for name, by in sorted(self.data["counters"].items()):
            for key, n in sorted(by.items()):
                if n:
                    out["_".join([name, *key.split("|")]) if key else name] = n
        for name, values in sorted(self.data["observations"].items()):
            if values:
                out[f"{name}_count"] = len(values)
                out[f"{name}_mean"] = round(sum(values) / len(values), 3)
        return out

    def is_empty(self) -> bool:
        return not any(any(by.values()) for by in self.data["counters"].values()) and not any(
            self.data["observations"].values()
        )


class StatsRecorder:
    """One half's counts since vLLM last drained them (take())."""

    def __init__(self):
        self._lock = threading.Lock()
        self._stats = VeriCacheStats()
        self._looked_up: set[str] = set()  # requests whose lookup is counted (vLLM may ask again)
        self._proposer: tuple[int, dict[str, int]] | None = None  # (id, counts) of the proposer at the last take

    def count(self, name: str, *labels: str, n: float = 1) -> None:
        with self._lock:
            self._stats.count(name, *labels, n=n)

    def observe(self, name: str, value: float) -> None:
        with self._lock:
            self._stats.observe(name, value)

    def take(self) -> VeriCacheStats | None:
        with self._lock:
            got, self._stats = self._stats, VeriCacheStats()
        return None if got.is_empty() else got

    # ---- the scheduler half ----
    def lookup(self, rid: str, found: int | BaseException, client=None, prefix=None, spec: str = "") -> None:
        """A request's lookup (counted once per request): `found` tokens or the error it raised. A miss's reason
        is read off the store on its loop; the count lands when it is known."""
        with self._lock:
            if rid in self._looked_up:
                return
            self._looked_up.add(rid)
            self._stats.count("lookups")
            if not isinstance(found, BaseException) and found > 0:
                self._stats.count("hits", "full")
                return
            if isinstance(found, BaseException) or client is None:
                self._stats.count("misses", "full", "store_down")
                self._stats.count("store_errors", "lookup")
                return
        try:
            fut = client.submit(full_miss_reason(client.store, prefix, spec))
        except Exception:  # noqa: BLE001 - the client is closing: the store is gone
            self.count("misses", "full", "store_down")
            return
        fut.add_done_callback(self._classified)

    def _classified(self, fut) -> None:
        try:
            reason = fut.result()
        except BaseException:  # noqa: BLE001 - the store stopped answering meanwhile
            reason = "store_down"
        self.count("misses", "full", reason)

    def forget(self, rid: str) -> None:
        with self._lock:
            self._looked_up.discard(rid)

    # ---- the worker half ----
    def miss(self, copy: str, error: BaseException | None = None, op: str = "fetch_compressed") -> None:
        """A copy not there to use: `error` None is a lone copy (the other copy is there)."""
        reason = "lone_copy" if error is None else miss_reason(error)
        with self._lock:
            self._stats.count("misses", copy, reason)
            if reason == "store_down":
                self._stats.count("store_errors", op)

    def load_failed(self, error: BaseException) -> None:
        reason = miss_reason(error)
        with self._lock:
            self._stats.count("load_failures", reason)
            if reason == "store_down":
                self._stats.count("store_errors", "load")

    def saved(self, result) -> None:
        """A put_prefix's PutResult."""
        with self._lock:
            self._stats.count("saves")
            self._stats.count("bytes_written", "full", n=result.full_bytes)
            self._stats.count("bytes_written", "compressed", n=sum(result.compressed_bytes.values()))

    def proposer(self, drafter) -> None:
        """What the proposer counted since the last call (its counters only grow)."""
        if drafter is None or not hasattr(drafter, "stats"):
            return
        now = {
            "predrafted_tokens": drafter.stats.get("predrafted", 0),
            "drafted_tokens": drafter.stats.get("drafted", 0),
            **{f"accepted|{s}": n for s, n in getattr(drafter, "accepted", {}).items()},
        }
        last = self._proposer[1] if self._proposer is not None and self._proposer[0] == id(drafter) else {}
        self._proposer = (id(drafter), now)
        with self._lock:
            for key, n in now.items():
                if n > last.get(key, 0):
                    name, *labels = ("accepted_tokens", key.split("|")[1]) if key.startswith("accepted|") else (key,)
                    self._stats.count(name, *labels, n=n - last.get(key, 0))


class VeriCachePromMetrics(KVConnectorPromMetrics):
    """The SERIES as prometheus_client metrics (vLLM's classes: its registry, its multiprocess mode), labelled with
    vLLM's labels (model_name, engine) + their own."""

    def __init__(self, vllm_config, metric_types, labelnames: list[str], per_engine_labelvalues: dict[int, list]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        _unregister()  # made again in one process (vLLM does the same for its own "vllm:" series)
        self.metrics: dict[str, Any] = {}
        for name, s in SERIES.items():
            cls = self._counter_cls if s.kind == "counter" else self._histogram_cls
            kw = {"buckets": list(s.buckets)} if s.kind == "histogram" else {}
            m = cls(name=PREFIX + name, documentation=s.doc, labelnames=list(labelnames) + list(s.labels), **kw)
            self.metrics[name] = m
            for engine in per_engine_labelvalues.values():
                for values in s.values:
                    m.labels(*engine, *values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        engine = self.per_engine_labelvalues[engine_idx]
        for name, by in (transfer_stats_data or {}).get("counters", {}).items():
            m = self.metrics.get(name)
            if m is None:
                continue
            for key, n in by.items():
                if n > 0:
                    m.labels(*engine, *(key.split("|") if key else ())).inc(n)
        for name, values in (transfer_stats_data or {}).get("observations", {}).items():
            m = self.metrics.get(name)
            if m is not None:
                child = m.labels(*engine)
                for v in values:
                    child.observe(v)


def _unregister() -> None:
    from prometheus_client import REGISTRY

    names = {PREFIX + n for n in SERIES}
    for collector in list(REGISTRY._collector_to_names):
        if getattr(collector, "_name", None) in names:
            REGISTRY.unregister(collector)


def register_name(cls) -> None:
    """Register `cls` in vLLM's connector registry by its class name: inside MultiConnector, vLLM's logging stat
    logger rebuilds each child's stats with KVConnectorFactory.get_connector_class_by_name(<class name>), which
    knows only registered connectors (ours is loaded by module path), and would raise on our first stats."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(cls.__name__, cls.__module__, cls.__name__)
    except ValueError:  # registered already (this module imported twice, or vLLM ships one of that name)
        pass
