"""The Kubernetes deployment in k8s/, read offline for the tests/unit/test_k8s_*.py checks.

The objects a user would apply (plain manifests, Secret examples, the Helm values' extraObjects, and the engine
Deployment, ConfigMap and model PVC the production-stack chart would render from our values), the values
merged with their overlays as Helm does, the chart's keys (k8s/helm/vllm-stack-values.subset.schema.json),
and what k8s/Dockerfile installs and which of its roles every container of our image runs.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
from pathlib import Path

import jsonschema
import yaml

from paths import K8S

KUBE_VERSIONS = ("1.29", "1.37")  # oldest we claim; newest that kubernetes-validate 1.37.0 bundles


MANIFESTS = sorted((K8S / "manifests").rglob("*.yaml")) + sorted((K8S / "secrets").glob("*.yaml"))


SECRETS = {p.name.split(".")[0]: p for p in sorted((K8S / "secrets").glob("*.example.yaml"))}


RELEASE = "vericache"


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


def values_validator() -> jsonschema.Draft202012Validator:
    schema = json.loads((K8S / "helm" / "vllm-stack-values.subset.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def pod_labels(deployment: dict) -> dict:
    return deployment["spec"]["template"]["metadata"]["labels"]


# -- One image for every role ------------------------------------------------------------------------


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
