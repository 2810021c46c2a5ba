"""Stable path for the speculative config's ``"model"`` with ``"method": "custom_class"``
(vericache_connector.vllm_proposer.CompressedKVProposer): the proposer lives in
vericache_connector.integration.vllm.proposer."""

from .integration.vllm.proposer import CompressedKVProposer

__all__ = ["CompressedKVProposer"]
