"""vLLM integration (as LMCache's lmcache/integration/vllm/), by the role each part plays inside vLLM.

connector/       the KV connector vLLM loads (kv_connector_module_path): facade.py (VeriCacheConnector, a thin
                 facade), config.py (kv_connector_extra_config -> ConnectorSpec), scheduler.py + load_plan.py
                 (the scheduler half: what to load, load or recompute), worker.py + loads.py + split_load.py (the
                 worker half and its load strategies), drafter.py (the drafter role), metadata.py, paged_layout.py,
                 stats.py
proposer/        the speculative proposer vLLM calls after each step (CompressedKVProposer): proposing,
                 pre-drafting, measuring, pacing, the draft state (chains, rows) and the draft forward
handoff.py       the one seam between them: compressed copies posted by the worker, one pacing object asked
router_plugins.py  the ASGI middlewares of `vericache router`'s vLLM servers (RouterOnly, VerifyRoute)

Users name the stable paths vericache_connector.vllm_connector, vericache_connector.vllm_proposer and
vericache_connector.vllm_router. Importing this package imports nothing of vLLM.
"""
