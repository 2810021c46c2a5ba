"""vericache_connector.metrics, the API the services' /metrics are built on (the verifier's and the drafter's are
tested with them in test_hardening_verifier.py): a registry per Metrics, names asked for twice are the same metric,
/metrics on an aiohttp app and on a port of its own."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest
from prometheus_client import Counter
from prometheus_client.parser import text_string_to_metric_families

from vericache_connector.metrics import (
    CONTENT_TYPE,
    Metrics,
    add_metrics_route,
    metrics_handler,
    process_metrics,
    serve_metrics,
)


def values(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_metrics_of_one_service_in_a_registry_of_its_own():
    a, b = Metrics("vericache_router"), Metrics("vericache_router")
    requests = a.counter("requests", "Requests answered.", ["route"])
    assert isinstance(requests, Counter) and a.counter("requests", "Requests answered.", ["route"]) is requests
    requests.labels("/v1/completions").inc(2)
    b.counter("requests", "Requests answered.", ["route"]).labels("/v1/completions").inc()
    assert values(a.render().decode())["vericache_router_requests_total", (("route", "/v1/completions"),)] == 2
    assert values(b.render().decode())["vericache_router_requests_total", (("route", "/v1/completions"),)] == 1
    with pytest.raises(ValueError, match="exists as a Counter"):
        a.gauge("requests", "not a counter")
    assert process_metrics() is process_metrics()
    assert ("process_resident_memory_bytes", ()) in values(a.render().decode())


def test_metrics_route_on_an_aiohttp_app_and_on_a_port_of_its_own():
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    m = Metrics("vericache_router")
    m.histogram("request_seconds", "Time to answer.").observe(0.3)
    m.gauge("queued_requests", "Waiting.").set(4)
    app = web.Application()
    add_metrics_route(app, m)
    app.router.add_get("/other", metrics_handler(m))

    async def get():
        async with TestClient(TestServer(app, host="127.0.0.1")) as c:
            r = await c.get("/metrics")
            return r.status, r.headers["Content-Type"], await r.text()

    status, ctype, text = asyncio.run(get())
    assert status == 200 and ctype == CONTENT_TYPE
    got = values(text)
    assert got["vericache_router_queued_requests", ()] == 4 and got["vericache_router_request_seconds_count", ()] == 1
    server = serve_metrics(m, "127.0.0.1", 0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as r:
            assert values(r.read().decode())["vericache_router_queued_requests", ()] == 4
    finally:
        server.close()
