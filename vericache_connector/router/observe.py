"""The router's /metrics (prometheus_client, vericache_connector.metrics): what it answered and how.

vericache_router_requests_total{route, path}   answered requests: path verified | direct | plain | alone |
                                                fallback | passed (to a verifier as they came) | refused |
                                                failed | gone
vericache_router_request_seconds{route}        time to answer (histogram)
vericache_router_verify_calls_total            verify calls answered
vericache_router_accepted_drafts               drafts accepted per verify call (histogram)
vericache_router_fallbacks_total{role}         requests finished on a verifier alone after a fault of a drafter
                                                or a verifier
vericache_router_verify_queue                  verify calls out now, every verifier together
vericache_router_upstream_auth_failures_total  upstream answers 401 / 403 (the router token is not accepted)
vericache_router_direct_slots                  requests a verifier decodes by itself at a time now (slots.py)
"""

from __future__ import annotations

from ..metrics import COUNT_BUCKETS, SECONDS_BUCKETS, Metrics


class RouterMetrics:
    def __init__(self, verifiers, slots=None):
        self.m = m = Metrics("vericache_router")
        self.requests = m.counter(
            "requests", "Requests answered, by route and how they were served.", ["route", "path"]
        )
        self.seconds = m.histogram("request_seconds", "Time to answer a request.", ["route"], buckets=SECONDS_BUCKETS)
        self.verify_calls = m.counter("verify_calls", "Verify calls answered.")
        self.accepted = m.histogram("accepted_drafts", "Drafts accepted per verify call.", buckets=COUNT_BUCKETS)
        self.fallbacks = m.counter("fallbacks", "Requests finished on a verifier alone after a fault.", ["role"])
        self.auth_failures = m.counter("upstream_auth_failures", "Upstream answers 401 / 403 to the router token.")
        queue = m.gauge("verify_queue", "Verify calls out now, every verifier together.")
        queue.set_function(lambda: sum(s.inflight for s in verifiers.servers))
        if slots is not None:
            m.gauge("direct_slots", "Requests a verifier decodes by itself at a time now.").set_function(
                lambda: slots.limit
            )

    def answered(self, route: str, path: str, seconds: float, stats=None) -> None:
        self.requests.labels(route, path).inc()
        self.seconds.labels(route).observe(seconds)
        if stats is None:
            return
        self.verify_calls.inc(stats.verify_calls)
        for n in stats.accepted:
            self.accepted.observe(n)
        if stats.path == "fallback" and stats.cause:
            self.fallbacks.labels(stats.cause.split(" ", 1)[0]).inc()  # "drafter ..." / "verifier ..."
