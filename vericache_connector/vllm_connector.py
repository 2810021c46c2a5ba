"""Stable path for ``kv_connector_module_path`` (vLLM imports it and takes VeriCacheConnector from it):
the connector lives in vericache_connector.integration.vllm.connector.facade."""

from .integration.vllm.connector.facade import VeriCacheConnector

__all__ = ["VeriCacheConnector"]
