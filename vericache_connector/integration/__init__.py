"""Integrations with serving systems (vllm/: the vLLM KV connector and proposer)."""
