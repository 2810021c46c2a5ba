"""vLLM drafter and verifier pools behind `vericache router` in k8s/ (k8s/manifests/router/,
k8s/helm/values-router.yaml), checked offline, plain and Helm: the verifier pool beside the store and the
drafters elsewhere, each in its connector role; only the router reaches the drafters; users call the router.
"""

from __future__ import annotations

import json
from urllib.parse import urlsplit

import pytest

from vericache_connector.integration.vllm.connector.config import load_kv_transfer_config

from k8s_objects import (
    RELEASE,
    SECRETS,
    all_objects,
    docs,
    find,
    helm_values,
    kv_transfer_config,
    pod_labels,
    render_engine,
    secret_env,
    secret_volume_of,
    vllm_container,
)
from paths import K8S

ROUTER_GUARD = "vericache_connector.vllm_router.RouterOnly"


VERIFY_ROUTE = "vericache_connector.vllm_router.VerifyRoute"


def router_topologies() -> dict[str, dict]:
    """{plain | helm: {verifier, drafter: (Deployment, vLLM argv), router, policy, services: {host: port}}}"""
    redis = docs(K8S / "manifests" / "redis" / "redis.yaml")
    plain = docs(K8S / "manifests" / "router" / "vllm-pools.yaml") + docs(K8S / "manifests" / "router" / "router.yaml")
    values = helm_values("values-router.yaml")
    engines = {spec["name"]: render_engine(values, spec)[0] for spec in values["servingEngineSpec"]["modelSpec"]}
    port = values["servingEngineSpec"].get("containerPort", 8000)
    out = {}
    for name, objects, pools, services in (
        (
            "plain",
            plain,
            {r: find(plain, "Deployment", f"vericache-vllm-{r}") for r in ("verifier", "drafter")},
            {s["metadata"]["name"]: s["spec"]["ports"][0]["port"] for s in plain if s["kind"] == "Service"},
        ),
        ("helm", values["extraObjects"], engines, {f"{RELEASE}-{r}-engine-service": port for r in engines}),
    ):
        argv = {r: (lambda c: c.get("command", []) + c.get("args", []))(vllm_container(d)) for r, d in pools.items()}
        out[name] = {
            **{r: (d, argv[r]) for r, d in pools.items()},
            "router": find(objects, "Deployment", "vericache-router"),
            "policy": next(o for o in objects if o["kind"] == "NetworkPolicy" and "drafter" in o["metadata"]["name"]),
            "services": services,
            "redis": find(redis, "Deployment", "vericache-redis"),
            "objects": objects,
        }
    return out


@pytest.mark.parametrize("topology", ["plain", "helm"])
def test_router_pools_verifier_beside_the_store_drafters_elsewhere(topology):
    from vericache_connector.compressors import GROUPS, get_compressor
    from vericache_connector.integration.vllm.connector.config import connector_role

    t = router_topologies()[topology]
    redis_labels = pod_labels(t["redis"])
    (verifier, v_argv), (drafter, d_argv) = t["verifier"], t["drafter"]
    (near,) = verifier["spec"]["template"]["spec"]["affinity"]["podAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert near["topologyKey"] == "kubernetes.io/hostname"
    assert near["labelSelector"]["matchLabels"].items() <= redis_labels.items()
    away = drafter["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    assert any(a["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= redis_labels.items() for a in away)
    assert drafter["spec"]["replicas"] >= 2
    env = {**secret_env("redis"), "VERICACHE_COMPRESSOR": "kivi4"}
    quantizers = next(names for names in GROUPS.values() if "kivi" in names)
    for argv, role, middleware in ((v_argv, "serve", VERIFY_ROUTE), (d_argv, "drafter", ROUTER_GUARD)):
        text = kv_transfer_config(argv)
        cfg = load_kv_transfer_config(text, env)  # parses as the pod would (store from the Secret)
        assert connector_role(json.loads(text).get("kv_connector_extra_config")) == role
        assert argv[argv.index("--middleware") + 1] == middleware
        assert "--enable-prefix-caching" in argv and int(argv[argv.index("--block-size") + 1]) % 32 == 0
        assert get_compressor(cfg.compressor).name in quantizers  # the drafter role refuses token dropping
    for deployment in (verifier, drafter):  # both read the store, through its NetworkPolicy
        assert {"vericache-store-client": "true"}.items() <= pod_labels(deployment).items()


@pytest.mark.parametrize("topology", ["plain", "helm"])
def test_only_the_router_reaches_the_drafters_and_users_call_the_router(topology):
    from vericache_connector.cli import build_parser

    t = router_topologies()[topology]
    drafter, router, policy = t["drafter"][0], t["router"], t["policy"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels(drafter).items()
    (rule,) = policy["spec"]["ingress"]
    (source,) = rule["from"]
    assert set(source) == {"podSelector"}  # no namespaceSelector / ipBlock widening it
    allowed = source["podSelector"]["matchLabels"]
    assert allowed.items() <= pod_labels(router).items()
    everything = all_objects() + [
        o for ov in ("values-verifier.yaml", "values-router.yaml") for o in helm_values(ov)["extraObjects"]
    ]
    everything += [
        render_engine(helm_values("values-router.yaml"), s)[0]
        for s in helm_values("values-router.yaml")["servingEngineSpec"]["modelSpec"]
    ]
    for other in everything:  # no other pod carries the router's label
        if other["kind"] == "Deployment" and other["metadata"]["name"] != "vericache-router":
            assert not allowed.items() <= pod_labels(other).items(), other["metadata"]["name"]
    (port,) = rule["ports"]
    assert port["port"] == vllm_container(drafter)["ports"][0]["containerPort"] == 8000
    # the router: its own arguments, the pools' Services, the token from the Secret as a file
    (c,) = router["spec"]["template"]["spec"]["containers"]
    args = build_parser().parse_args(c["command"][1:] + c["args"])
    assert args.command == "router" and args.host == "0.0.0.0"
    for urls, pool in ((args.verifier, "verifier"), (args.drafter, "drafter")):
        (url,) = urls
        parts = urlsplit(url)
        assert t["services"][parts.hostname] == parts.port and pool in parts.hostname
    env = {e["name"]: e for e in c["env"]}
    item = secret_volume_of(router, c, env["VERICACHE_ROUTER_TOKEN_FILE"]["value"])
    assert item == {"key": "VERICACHE_ROUTER_TOKEN", "path": "token", "secretName": "vericache-router"}
    assert docs(SECRETS["router"])[0]["stringData"].keys() == {"VERICACHE_ROUTER_TOKEN"}
    d_env = {e["name"]: e for e in vllm_container(drafter)["env"]}
    assert d_env["VERICACHE_ROUTER_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "vericache-router",
        "key": "VERICACHE_ROUTER_TOKEN",
    }
    if topology == "helm":  # the chart's own router would send users to any engine, drafters included
        assert helm_values("values-router.yaml")["routerSpec"]["enableRouter"] is False
    else:
        service = find(t["objects"], "Service", "vericache-router")
        assert service["spec"]["selector"].items() <= pod_labels(router).items()
