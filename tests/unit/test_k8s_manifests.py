"""The Kubernetes objects in k8s/, checked offline: every manifest (plain, Secret examples, the Helm values'
extraObjects, and what the production-stack chart would render from our values) against the Kubernetes API
schemas that kubernetes-validate bundles (strict: unknown fields fail); the same Redis with and without Helm;
the engines' replicas and probes; who reaches Redis; the one model, served from a volume.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from urllib.parse import unquote, urlsplit

import kubernetes_validate
import pytest

from k8s_objects import (
    KUBE_VERSIONS,
    MANIFESTS,
    all_objects,
    docs,
    find,
    helm_objects,
    helm_values,
    render_engine,
    render_pvc,
    secret_env,
    vllm_container,
)
from paths import K8S

# -- Kubernetes API schemas ---------------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(K8S)))
def test_plain_manifests_validate(path, version):
    objects = docs(path)
    assert objects, f"{path} holds no objects"
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_helm_objects_validate(version):
    values = helm_values()
    for obj in values["extraObjects"] + helm_objects(values):
        kubernetes_validate.validate(obj, version, strict=True)


def test_validator_rejects_wrong_types_and_unknown_fields():
    (good,) = docs(K8S / "manifests" / "vllm-deployment.yaml")
    kubernetes_validate.validate(good, KUBE_VERSIONS[-1], strict=True)
    for path, value in (
        (("spec", "replicas"), "two"),
        (("spec", "template", "spec", "containers", 0, "ports", 0, "containerPort"), "8000"),
        (("spec", "template", "spec", "containers", 0, "imagee"), "typo"),
    ):
        bad = copy.deepcopy(good)
        node = bad
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, KUBE_VERSIONS[-1], strict=True)


def test_redis_objects_are_the_same_with_and_without_helm():
    assert helm_values()["extraObjects"] == docs(K8S / "manifests" / "redis" / "redis.yaml")
    assert helm_values("values-s3.yaml")["extraObjects"] == []


def test_two_vllm_replicas_with_health_probes():
    values = helm_values()
    plain = find(docs(K8S / "manifests" / "vllm-deployment.yaml"), "Deployment", "vericache-vllm")
    (rendered, _) = render_engine(values, values["servingEngineSpec"]["modelSpec"][0])
    for deployment in (plain, rendered):
        assert deployment["spec"]["replicas"] == 2
        c = vllm_container(deployment)
        ports = {p.get("name"): p["containerPort"] for p in c["ports"]}
        for name in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = c[name]["httpGet"]
            assert get["path"] == "/health" and ports.get(get["port"], get["port"]) == 8000, (name, get)
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    assert vllm_container(plain)["command"] == ["python", "-m", "vllm.entrypoints.openai.api_server"]


def test_redis_is_reachable_from_the_engines_only():
    redis = docs(K8S / "manifests" / "redis" / "redis.yaml")
    allowed = find(redis, "NetworkPolicy", "vericache-redis")["spec"]["ingress"][0]["from"][0]["podSelector"]
    plain = find(docs(K8S / "manifests" / "vllm-deployment.yaml"), "Deployment", "vericache-vllm")
    values = helm_values()
    (rendered, _) = render_engine(values, values["servingEngineSpec"]["modelSpec"][0])
    for deployment in (plain, rendered):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert allowed["matchLabels"].items() <= labels.items()
    url = urlsplit(secret_env("redis")["VERICACHE_STORE_URL"])
    service = find(redis, "Service", "vericache-redis")
    assert (url.hostname, url.port) == (service["metadata"]["name"], service["spec"]["ports"][0]["port"])
    assert unquote(url.password) == secret_env("redis")["REDIS_PASSWORD"]  # percent-encoded in the URL


# -- The model: one, the Instruct one, from a volume --------------------------------------------------


MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the bundled model (model/loader.py), as the local examples serve it


MODEL_DIR = "/models/smollm2-135m-instruct"  # its files on the volume k8s/manifests/models.yaml fills


def mounts(pod: dict, container: dict) -> dict[str, tuple[dict, dict]]:
    """{mountPath: (volumeMount, volume)} of a container."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    return {m["mountPath"]: (m, volumes[m["name"]]) for m in container.get("volumeMounts", [])}


@pytest.mark.parametrize(
    "overlays", [(), ("values-s3.yaml",), ("values-verifier.yaml",), ("values-s3.yaml", "values-lmcache-mp.yaml")]
)
def test_helm_engines_serve_the_instruct_model_from_the_charts_model_volume(overlays):
    values = helm_values(*overlays)
    for spec in values["servingEngineSpec"]["modelSpec"]:
        assert spec["modelURL"] == MODEL
        (deployment, _) = render_engine(values, spec)
        (pvc,) = render_pvc(values, spec)
        pod = deployment["spec"]["template"]["spec"]
        c = vllm_container(deployment)
        assert {e["name"]: e.get("value") for e in c["env"]}["HF_HOME"] == "/data"  # the hub's cache: the volume
        _, volume = mounts(pod, c)["/data"]
        assert volume["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
        # the replicas are spread over nodes: they must all mount it
        assert spec["replicaCount"] > 1 and pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def test_plain_pods_read_the_model_from_the_volume_the_job_fills():
    models = docs(K8S / "manifests" / "models.yaml")
    pvc = find(models, "PersistentVolumeClaim", "vericache-models")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    job = find(models, "Job", "vericache-models")
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["command"][:2] == ["python", "-c"] and c["command"][3:5] == [MODEL, MODEL_DIR]
    m, volume = mounts(job["spec"]["template"]["spec"], c)[str(Path(MODEL_DIR).parent)]
    assert volume["persistentVolumeClaim"]["claimName"] == "vericache-models" and not m.get("readOnly")
    lmcache = helm_values("values-s3.yaml", "values-lmcache-mp.yaml")["extraObjects"]
    readers = [o for o in all_objects() + lmcache if o["kind"] in ("Deployment", "DaemonSet")]
    seen = set()
    for obj in readers:
        pod = obj["spec"]["template"]["spec"]
        for c in pod["containers"]:
            argv = c.get("command", []) + c.get("args", [])
            if not any(MODEL_DIR in a for a in argv):
                continue
            m, volume = mounts(pod, c)[str(Path(MODEL_DIR).parent)]
            assert volume["persistentVolumeClaim"] == {"claimName": "vericache-models", "readOnly": True}
            assert m["readOnly"] is True, obj["metadata"]["name"]
            seen.add(obj["metadata"]["name"])
            if "--served-model-name" in argv:
                assert argv[argv.index("--model") + 1] == MODEL_DIR
                assert argv[argv.index("--served-model-name") + 1] == MODEL
    assert seen == {"vericache-vllm", "vericache-verifier", "vericache-drafter", "vericache-lmcache"} | {
        "vericache-vllm-verifier",
        "vericache-vllm-drafter",
        "vericache-router",
    }
    (server,) = [o for o in lmcache if o["kind"] == "DaemonSet"]
    args = server["spec"]["template"]["spec"]["containers"][0]["args"]
    params = json.loads(args[args.index("--l2-adapter") + 1])["adapter_params"]
    assert (params["model_dir"], params["served_model"]) == (MODEL_DIR, MODEL)
