"""Stable path for ``kv_connector_module_path`` (vLLM imports it and takes VeriCacheConnector from it):
the connector lives in vericache_connector.integration.vllm.connector."""

from .integration.vllm.connector import VeriCacheConnector

__all__ = ["VeriCacheConnector"]
