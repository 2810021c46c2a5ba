"""The store path's compressor default is one value (remote.config.STORE_DEFAULT, query-agnostic KIVI-4), and
every way of configuring a store writer falls back to it: RemoteCacheConfig, the vLLM connector's
kv_connector_extra_config, the verifier / drafter command lines and the LMCache L2 adapter's settings."""

from __future__ import annotations

import argparse

from vericache_connector.store.config import STORE_DEFAULT, RemoteCacheConfig


def test_store_default_is_query_agnostic():
    from vericache_connector.compressors import get_compressor

    comp = get_compressor(STORE_DEFAULT)
    assert STORE_DEFAULT == "kivi4" and type(comp).__name__.lower().startswith("kivi")  # scores no positions


def test_every_store_config_defaults_to_it():
    from vericache_connector.integration.lmcache.l2_config import L2Settings
    from vericache_connector.integration.vllm.connector.config import load_connector_config
    from vericache_connector.remote.cli_args import add_drafter_args

    assert RemoteCacheConfig().compressor == STORE_DEFAULT
    assert load_connector_config({}, env={"VERICACHE_STORE_URL": "redis://r:6379/0"}).compressor == STORE_DEFAULT
    p = argparse.ArgumentParser()
    add_drafter_args(p)
    assert p.parse_args([]).compressor == STORE_DEFAULT
    assert L2Settings.__dataclass_fields__["compressor"].default == STORE_DEFAULT
