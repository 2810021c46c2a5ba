"""Stable path for the speculative config's ``"model"`` with ``"method": "custom_class"``
(vericache_connector.vllm_proposer.CompressedKVProposer): the proposer lives in
vericache_connector.integration.vllm.proposer.proposer."""

from .integration.vllm.proposer.proposer import CompressedKVProposer

__all__ = ["CompressedKVProposer"]
