"""`vericache router`: an OpenAI-compatible front of stock vLLM servers, drafts from drafter-role servers
(integration/vllm/connector/drafter.py) verified by a verifier server beside the store
(integration/vllm/router_plugins.py).

config.py (RouterConfig, its command-line options, the router token), server.py (Router and the HTTP
service), routes.py (its handlers: requests in, OpenAI answers out), paths.py (choose_path: which path serves a
request), decode.py (RoutedDecode: one request, on the path it takes), draft_loop.py (DraftLoop: its draft /
verify loop), slots.py (the direct slots' count), upstream.py (the pools of upstream servers and the calls made
to them). It imports only the model level (the accept and emit rules of model/sampling.py, the draft-sending
rule of model/draft_rule.py) and aiohttp; nothing here holds a model or a KV cache.
"""
