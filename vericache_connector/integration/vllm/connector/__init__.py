"""The KV connector vLLM loads (see ../__init__.py). Importing it imports nothing."""
