"""The compressed-KV proposer vLLM calls after each step (see ../__init__.py). Importing it imports nothing."""
