"""The verifier's Prometheus metrics (vericache_verifier_*), served by `vericache verifier --metrics-port`
(verifier_server.py; docs/operations.md#metrics): requests, verify calls, accepted drafts per call, queue
length, fallbacks by Failure code, auth failures, connections."""

from __future__ import annotations

from ..metrics import COUNT_BUCKETS, Metrics


class VerifierMetrics(Metrics):
    """The verifier's Prometheus metrics (vericache_verifier_*). What the server counts anyway (its core's counts,
    refused calls, the gate's refusals, queues and residents) is read at scrape time; accepted drafts per call and
    the forward's and the loads' seconds are observed as they happen. server: the VerifierServer it reads."""

    def __init__(self, server):
        super().__init__("vericache_verifier")
        self.server = server
        self.accepted = self.histogram(
            "accepted_drafts", "Drafts accepted per verify call (its drafts: drafts_total).", buckets=COUNT_BUCKETS
        )
        self.drafts = self.counter("drafts", "Drafts received in verify calls that were verified.")
        self.forward_seconds = self.histogram("forward_seconds", "Seconds per verify forward (a batch of calls).")
        self.load_seconds = self.histogram("load_seconds", "Seconds to load a request's full KV from the store.")
        self.register(self)

    def verified(self, batch, verdicts, seconds: float) -> None:
        self.forward_seconds.observe(seconds)
        for (_, call, _), verdict in zip(batch, verdicts):
            self.drafts.inc(len(call.drafts))
            self.accepted.observe(verdict.accepted)

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.server
        core, gate, failures = dict(s.core.counts), dict(s.gate.counts), dict(s.failures)

        def counter(name, doc, value=None, label=None, values=None):
            f = CounterMetricFamily(self.name(name), doc, labels=[label] if label else None)
            if label:
                for k, v in values.items():
                    f.add_metric([k], v)
            else:
                f.add_metric([], value)
            return f

        def gauge(name, doc, value):
            return GaugeMetricFamily(self.name(name), doc, value=value)

        yield counter(
            "requests", "Requests admitted: their full KV load started (again after it was freed).", core["loads"]
        )
        yield counter("verify_calls", "Verify calls verified (answered with a verdict).", core["calls"])
        yield counter("forwards", "Verify forwards (each verifies a batch of calls).", core["forwards"])
        yield counter(
            "freed_requests",
            "Requests whose full KV was freed: released by the drafter, expired (unused for --ttl-s), evicted (LRU).",
            label="why",
            values={k: core[k] for k in ("released", "expired", "evicted")},
        )
        yield counter(
            "fallbacks",
            "Calls answered with a Failure, by code: the drafter finishes that request on its own (a fallback).",
            label="code",
            values={c: failures.get(c, 0) for c in sorted({*FAILURE_CODES, *failures})},
        )
        yield counter(
            "auth_failures",
            "Refused peers: key (a handshake with a key not admitted, or no CURVE), handshake (a failed or stalled "
            "handshake), token (a call with a missing or wrong token).",
            label="kind",
            values={"key": gate["refused"], "handshake": gate["failed"], "token": failures.get("auth", 0)},
        )
        yield counter(
            "connections_closed",
            "Connections closed by the gate: over_cap (past --max-connections), evicted (a pending one, past "
            "--max-pending or --max-pending-per-address).",
            label="why",
            values={"over_cap": gate["cut"], "evicted": gate["evicted"]},
        )
        queues, residents = list(s.queues.values()), list(s.core.residents.values())
        yield gauge(
            "queued_calls",
            "Verify calls waiting: for their request's KV, or for the next forward.",
            sum(map(len, queues)),
        )
        yield gauge("loading_requests", "Requests whose full KV is loading from the store.", len(s.loading))
        yield gauge("resident_requests", "Requests whose full KV is held.", len(residents))
        yield gauge(
            "resident_bytes", "Bytes of full KV held (the budget: --memory-gb).", sum(r.nbytes for r in residents)
        )
        f = GaugeMetricFamily(
            self.name("connections"),
            "Open connections: admitted drafters, pending (no key shown yet).",
            labels=["state"],
        )
        f.add_metric(["admitted"], len(s.gate.open))
        f.add_metric(["pending"], len(s.gate.pending))
        yield f

    def describe(self):
        return []  # collect() reads live state: nothing to describe ahead


FAILURE_CODES = ("auth", "malformed", "too_large", "model", "store", "busy", "internal")  # rpc.Failure.code
