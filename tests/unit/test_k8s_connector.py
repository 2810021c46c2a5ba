"""The connector config the vLLM pods in k8s/ get (plain manifests and the Helm chart's rendered engines),
through the project's own loader, with the store URL from the Secret; the connector alone by default,
recomputing on a failed load; the documented (commented-out) proposer option still names a proposer.
"""

from __future__ import annotations

import json
import re

import pytest

from storage_backends import open_backend
from vericache_connector.integration.vllm.connector.config import load_kv_transfer_config

from k8s_objects import (
    all_objects,
    docs,
    find,
    helm_values,
    kv_transfer_config,
    render_engine,
    secret_env,
    vllm_container,
)
from paths import K8S


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
