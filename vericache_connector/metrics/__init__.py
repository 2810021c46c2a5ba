"""Prometheus metrics of VeriCache's own services (`vericache verifier`, `drafter`, `router`), with prometheus_client.

The vLLM connector does not use this: its series (`vericache_*` on a vLLM server's /metrics) go through vLLM's own
connector-stats path (integration/vllm/connector/stats.py). A service builds its metrics on a `Metrics` and serves them:

    from vericache_connector.metrics import Metrics, add_metrics_route, metrics_handler

    m = Metrics("vericache_router")                  # a registry of its own, process collectors included
    requests = m.counter("requests", "Requests answered.", ["route", "status"])  # vericache_router_requests_total
    seconds = m.histogram("request_seconds", "Time to answer a request.", ["route"])
    waiting = m.gauge("queued_requests", "Requests waiting for a server.")
    requests.labels("/v1/completions", "200").inc()

    app.router.add_get("/metrics", metrics_handler(m))   # aiohttp: the text exposition
    add_metrics_route(app, m)                             # the same, one call

`counter` / `gauge` / `histogram` return prometheus_client objects; asking again for a name already made returns
the same object (so a module may declare its metrics where it uses them, and building an app twice in one process,
as tests do, is no error). Names get the namespace in front (`vericache_router_` + name) and counters `_total` at
the end (prometheus_client's rule). One `Metrics` per service object keeps tests apart; `process_metrics()` is the
one per process for code that has no object to hang it on. A service without aiohttp (the ZeroMQ verifier) serves
its registry on a port of its own: `serve_metrics(m, host, port)` (port 0: any free one; `.port`, `.close()`).
`m.register(collector)` adds a prometheus_client collector whose `collect()` reads counts the service keeps anyway
(the verifier's refusal counts) at scrape time.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

__all__ = [
    "CONTENT_TYPE",
    "COUNT_BUCKETS",
    "SECONDS_BUCKETS",
    "Metrics",
    "MetricsServer",
    "add_metrics_route",
    "metrics_handler",
    "process_metrics",
    "serve_metrics",
]

CONTENT_TYPE = CONTENT_TYPE_LATEST
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
COUNT_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # drafts, tokens per call


class Metrics:
    """A service's metrics in a CollectorRegistry of its own (module docstring)."""

    def __init__(self, namespace: str = "vericache", registry: CollectorRegistry | None = None, process: bool = True):
        self.namespace = namespace.rstrip("_")
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._made: dict[str, object] = {}
        self._lock = threading.Lock()
        if process and registry is None:  # the process's CPU, memory, open files; Python's GC and version
            from prometheus_client import GCCollector, PlatformCollector, ProcessCollector

            ProcessCollector(registry=self.registry)
            PlatformCollector(registry=self.registry)
            GCCollector(registry=self.registry)

    def name(self, name: str) -> str:
        return f"{self.namespace}_{name}" if self.namespace else name

    def _make(self, cls, name: str, doc: str, labels: Sequence[str], **kw):
        full = self.name(name)
        with self._lock:
            got = self._made.get(full)
            if got is None:
                got = self._made[full] = cls(full, doc, list(labels), registry=self.registry, **kw)
            elif type(got) is not cls or tuple(got._labelnames) != tuple(labels):
                raise ValueError(f"metric {full!r} exists as a {type(got).__name__} with labels {got._labelnames}")
            return got

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return self._make(Counter, name, doc, labels)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = (), **kw) -> Gauge:
        return self._make(Gauge, name, doc, labels, **kw)

    def histogram(
        self, name: str, doc: str, labels: Sequence[str] = (), buckets: Iterable[float] = SECONDS_BUCKETS
    ) -> Histogram:
        return self._make(Histogram, name, doc, labels, buckets=tuple(buckets))

    def register(self, collector) -> None:
        """A prometheus_client collector (an object with collect() yielding metric families)."""
        self.registry.register(collector)

    def render(self) -> bytes:
        """The text exposition (what GET /metrics answers)."""
        return generate_latest(self.registry)


_process: Metrics | None = None
_process_lock = threading.Lock()


def process_metrics() -> Metrics:
    """This process's Metrics (namespace "vericache"), made on first use."""
    global _process
    with _process_lock:
        if _process is None:
            _process = Metrics()
        return _process


def metrics_handler(metrics: Metrics | None = None) -> Callable:
    """An aiohttp handler answering the text exposition of `metrics` (default: process_metrics())."""
    from aiohttp import web

    async def handler(_request) -> web.Response:
        m = metrics if metrics is not None else process_metrics()
        return web.Response(body=m.render(), headers={"Content-Type": CONTENT_TYPE})

    return handler


def add_metrics_route(app, metrics: Metrics | None = None, path: str = "/metrics") -> None:
    """GET `path` on an aiohttp app answers `metrics`' text exposition."""
    app.router.add_get(path, metrics_handler(metrics))


class MetricsServer:
    """/metrics over HTTP on a thread of its own (prometheus_client's WSGI server), for a service without one."""

    def __init__(self, metrics: Metrics, host: str, port: int):
        from prometheus_client import start_http_server

        self._server, self._thread = start_http_server(port, addr=host, registry=metrics.registry)
        self.host, self.port = host, self._server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def serve_metrics(metrics: Metrics, host: str, port: int) -> MetricsServer:
    """Serve `metrics` at http://host:port/metrics (port 0: any free port, see .port) until .close()."""
    return MetricsServer(metrics, host, port)
