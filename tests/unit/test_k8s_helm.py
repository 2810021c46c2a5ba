"""The Helm values in k8s/helm/, checked offline against the chart's keys
(k8s/helm/vllm-stack-values.subset.schema.json): values.yaml and every overlay, the schema refusing bad values,
and the chart's own LMCache config refused beside our --kv-transfer-config.
"""

from __future__ import annotations

import re

import jsonschema
import pytest

from k8s_objects import helm_values, values_validator
from paths import K8S


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
