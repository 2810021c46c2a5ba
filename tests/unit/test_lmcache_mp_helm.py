"""k8s/helm/values-lmcache-mp.yaml (LMCache multiprocess mode with VeriCache's store as its L2 tier), checked
offline like the other values files (tests/support/k8s_objects.py's helpers): the chart's keys, the Kubernetes
API schemas, credentials only from the Secret, and the server's --l2-adapter through LMCache's own parser."""

from __future__ import annotations

import argparse
import json

import kubernetes_validate
import pytest

from k8s_objects import KUBE_VERSIONS, helm_values, kv_transfer_config, render_engine, values_validator
from stores import has_module, need

OVERLAYS = ("values-s3.yaml", "values-lmcache-mp.yaml")


def server_container(values) -> dict:
    (ds,) = [o for o in values["extraObjects"] if o["kind"] == "DaemonSet"]
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    return c


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_overlay_uses_the_charts_keys_and_valid_objects(version):
    values = helm_values(*OVERLAYS)
    values_validator().validate(values)
    rendered = [o for spec in values["servingEngineSpec"]["modelSpec"] for o in render_engine(values, spec)]
    for obj in values["extraObjects"] + rendered:
        kubernetes_validate.validate(obj, version, strict=True)


def test_engines_reach_their_nodes_server_and_no_credential_is_on_argv():
    values = helm_values(*OVERLAYS)
    c = server_container(values)
    argv = c["command"] + c["args"]
    (deployment, _) = render_engine(values, values["servingEngineSpec"]["modelSpec"][0])
    (engine,) = deployment["spec"]["template"]["spec"]["containers"]
    extra = json.loads(kv_transfer_config(engine["command"]))["kv_connector_extra_config"]
    assert extra["lmcache.mp.host"] == "tcp://$(LMCACHE_HOST)" and "LMCACHE_HOST" in {e["name"] for e in engine["env"]}
    assert extra["lmcache.mp.port"] == c["ports"][0]["hostPort"] and "--port=5555" in argv
    assert extra["lmcache.mp.isolated_ipc"] and "--isolated-ipc" in argv
    env = {e["name"]: e for e in c["env"]}
    assert env["VERICACHE_STORE_URL"]["valueFrom"]["secretKeyRef"]["name"] == "vericache-store"
    assert not any("://" in a for a in argv)  # the store URL (maybe with a password) is not on argv


def test_servers_l2_adapter_parses_through_lmcache(monkeypatch):
    need(has_module("lmcache"), "lmcache is not installed")
    import importlib

    from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
    from lmcache.v1.distributed.l2_adapters.config import add_l2_adapters_args, parse_args_to_l2_adapters_config

    args = server_container(helm_values(*OVERLAYS))["args"]
    monkeypatch.setenv("VERICACHE_STORE_URL", "s3://bucket/prefix?endpoint_url=http://minio:9000")
    parser = add_l2_adapters_args(argparse.ArgumentParser())
    (plugin,) = parse_args_to_l2_adapters_config(
        parser.parse_args(["--l2-adapter", args[args.index("--l2-adapter") + 1]])
    ).adapters
    module = importlib.import_module(plugin.module_path)
    assert issubclass(getattr(module, plugin.class_name), L2AdapterInterface)
    settings = getattr(module, plugin.class_name + "Config").from_dict(plugin.adapter_params).settings  # as the factory
    assert settings.url.startswith("s3://") and settings.head_dim == 64 and settings.compressor == "kivi4"
    tap = json.loads(args[args.index("--server-module") + 1])
    assert callable(getattr(importlib.import_module(tap["module_path"]), "build_server_modules"))
