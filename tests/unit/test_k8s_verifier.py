"""Drafters + verifier in k8s/ (k8s/manifests/verifier/, k8s/helm/values-verifier.yaml), checked offline: the
overlay is the plain manifests, the verifier sits next to the store and the drafters elsewhere, only the
drafters reach the verifier, and both read their token and CURVE keys from the Secret as files.
"""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest

from k8s_objects import KUBE_VERSIONS, SECRETS, all_objects, docs, find, helm_values, pod_labels, secret_volume_of
from paths import K8S


def verifier_objects() -> list[dict]:
    return docs(K8S / "manifests" / "verifier" / "verifier.yaml") + docs(
        K8S / "manifests" / "verifier" / "drafters.yaml"
    )


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_verifier_overlay_is_the_plain_manifests(version):
    objects = helm_values("values-verifier.yaml")["extraObjects"]
    assert objects == docs(K8S / "manifests" / "redis" / "redis.yaml") + verifier_objects()
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)


def test_verifier_sits_next_to_the_store_and_drafters_elsewhere():
    objects = verifier_objects()
    redis = find(docs(K8S / "manifests" / "redis" / "redis.yaml"), "Deployment", "vericache-redis")
    verifier, drafter = (
        find(objects, "Deployment", "vericache-verifier"),
        find(objects, "Deployment", "vericache-drafter"),
    )
    (near,) = verifier["spec"]["template"]["spec"]["affinity"]["podAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert near["topologyKey"] == "kubernetes.io/hostname"
    assert near["labelSelector"]["matchLabels"].items() <= pod_labels(redis).items()
    away = drafter["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    assert any(t["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= pod_labels(redis).items() for t in away)
    assert drafter["spec"]["replicas"] >= 2 and verifier["spec"]["replicas"] == 1
    # both read the store: through the Redis NetworkPolicy
    store_np = find(docs(K8S / "manifests" / "redis" / "redis.yaml"), "NetworkPolicy", "vericache-redis")
    store_clients = store_np["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    assert (
        store_clients.items() <= pod_labels(verifier).items() and store_clients.items() <= pod_labels(drafter).items()
    )


def test_only_drafters_reach_the_verifier():
    objects = verifier_objects()
    verifier, drafter = (
        find(objects, "Deployment", "vericache-verifier"),
        find(objects, "Deployment", "vericache-drafter"),
    )
    policy, service = (
        find(objects, "NetworkPolicy", "vericache-verifier"),
        find(objects, "Service", "vericache-verifier"),
    )
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels(verifier).items()
    (container,) = verifier["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    rule, scrape = policy["spec"]["ingress"]  # the verify port to the drafters; the metrics port to Prometheus
    assert [p["port"] for p in scrape["ports"]] == [ports["metrics"]] != [ports["verify"]]
    assert scrape["from"] == [
        {"namespaceSelector": {}, "podSelector": {"matchLabels": {"vericache-metrics-scraper": "true"}}}
    ]
    (source,) = rule["from"]
    allowed = source["podSelector"]["matchLabels"]
    assert set(source) == {"podSelector"}  # no namespaceSelector / ipBlock widening it
    assert allowed.items() <= pod_labels(drafter).items()
    for other in all_objects() + docs(K8S / "manifests" / "redis" / "redis.yaml"):
        if other["kind"] == "Deployment" and other["metadata"]["name"] != "vericache-drafter":
            assert not allowed.items() <= pod_labels(other).items(), other["metadata"]["name"]
    (port,) = rule["ports"]
    (cport,) = [p for p in container["ports"] if p["name"] == "verify"]
    (sport,) = service["spec"]["ports"]
    assert port["port"] == cport["containerPort"] == sport["port"] and sport["targetPort"] == cport["name"]
    (dc,) = drafter["spec"]["template"]["spec"]["containers"]
    assert f"tcp://{service['metadata']['name']}:{sport['port']}" in dc["args"]


def test_verifier_and_drafters_parse_their_args_and_read_the_token_from_the_secret_file():
    from vericache_connector.cli import build_parser

    secret = docs(SECRETS["verifier"])[0]
    for name, sub in (("vericache-verifier", "verifier"), ("vericache-drafter", "drafter")):
        deployment = find(verifier_objects(), "Deployment", name)
        (c,) = deployment["spec"]["template"]["spec"]["containers"]
        assert c["command"] == ["vericache", sub]
        args = build_parser().parse_args(c["command"][1:] + c["args"])
        assert args.command == sub and args.host == "0.0.0.0" and args.store is None and args.token_file is None
        env = {e["name"]: e for e in c["env"]}
        assert env["VERICACHE_STORE_URL"]["valueFrom"]["secretKeyRef"]["name"] == "vericache-store"
        item = secret_volume_of(deployment, c, env["VERICACHE_VERIFIER_TOKEN_FILE"]["value"])
        assert item["secretName"] == secret["metadata"]["name"] and item["key"] in secret["stringData"]
        volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v.get("secret"))
        assert volume["secret"]["defaultMode"] & 0o007 == 0
        assert "VERICACHE_VERIFIER_TOKEN" not in env  # never the value itself
        assert not any("TOKEN" in a.upper() for a in c["args"])


def test_verifier_and_drafters_read_their_curve_keys_from_the_secret(tmp_path):
    """Issue 28: the CURVE keys are Secret items mounted as files; each pod mounts only its own side's
    (the verifier: its secret key and the drafters' public keys; a drafter: its secret key and the
    verifier's public key). Laid out as the pods see them, with real keys, both sides load them and the
    drafter's key is admitted by the verifier."""
    from vericache_connector.remote import auth

    secret = docs(SECRETS["verifier"])[0]
    wants = {
        "vericache-verifier": {auth.SECRET_KEY_ENV, auth.CLIENT_KEYS_ENV},
        "vericache-drafter": {auth.CLIENT_SECRET_KEY_ENV, auth.PUBLIC_KEY_ENV},
    }
    generated = auth.write_keys(str(tmp_path / "generated"))  # what the Secret would hold
    values = {name.removesuffix("_FILE"): Path(path).read_text() for name, path in generated.items()}
    loaded = {}
    for name, want in wants.items():
        deployment = find(verifier_objects(), "Deployment", name)
        (c,) = deployment["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e for e in c["env"]}
        assert not [k for k in env if k.startswith("VERICACHE_VERIFIER_") and "KEY" in k and not k.endswith("_FILE")]
        keys = {k.removesuffix("_FILE") for k in env if "KEY" in k and k.startswith("VERICACHE_VERIFIER_")}
        assert keys == want, (name, keys)  # its own side's keys, nothing of the other side's
        mounted = {
            i["key"]
            for v in deployment["spec"]["template"]["spec"]["volumes"]
            if v.get("secret")
            for i in v["secret"]["items"]
        }
        assert mounted == want | {"VERICACHE_VERIFIER_TOKEN"}, (name, mounted)
        pod_env = {}
        for var in want:
            item = secret_volume_of(deployment, c, env[f"{var}_FILE"]["value"])
            assert item["secretName"] == secret["metadata"]["name"] and item["key"] in secret["stringData"]
            path = tmp_path / name / item["path"]
            path.parent.mkdir(exist_ok=True)
            path.write_text(values[item["key"]])
            pod_env[f"{var}_FILE"] = str(path)
        loaded[name] = (auth.server_keys if name == "vericache-verifier" else auth.client_keys)(pod_env)
    verifier, drafter = loaded["vericache-verifier"], loaded["vericache-drafter"]
    from zmq.utils import z85

    assert drafter.server == verifier.public and z85.decode(drafter.public) in verifier.clients
    with pytest.raises(ValueError, match="not a CURVE key"):  # the example's placeholders are not keys
        auth.server_keys({k: v for k, v in secret["stringData"].items() if k in wants["vericache-verifier"]})
