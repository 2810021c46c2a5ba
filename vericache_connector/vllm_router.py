"""Stable path for the ASGI middlewares of `vericache router`'s vLLM servers (vLLM's ``--middleware``):
vericache_connector.vllm_router.RouterOnly (a drafter-role server answers only the router) and
vericache_connector.vllm_router.VerifyRoute (the verifier's POST /v1/vericache/verify); both live in
vericache_connector.integration.vllm.router_plugins."""

from .integration.vllm.router_plugins import RouterOnly, VerifyRoute

__all__ = ["RouterOnly", "VerifyRoute"]
