"""`vericache router`: an OpenAI-compatible front of stock vLLM servers, drafts from drafter-role servers
(integration/vllm/connector/drafter.py) verified by a verifier server beside the store
(integration/vllm/router_plugins.py).

config.py (RouterConfig, its command-line options, the router token), server.py (the HTTP service:
requests in, OpenAI answers out), decode.py (RoutedDecode: one request's draft / verify loop), upstream.py
(the pools of upstream servers and the calls made to them). It imports only the model level (the accept
and emit rules of model/sampling.py) and aiohttp; nothing here holds a model or a KV cache.
"""
