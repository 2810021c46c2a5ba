"""vLLM integration (as LMCache's lmcache/integration/vllm/): the KV connector and the proposer.

connector.py (VeriCacheConnector: the facade vLLM loads), scheduler.py / worker.py (its two halves),
metadata.py (what the scheduler side sends the workers), handoff.py (compressed copies from the
connector to the proposer), proposer.py (CompressedKVProposer: drafts on the compressed copy),
paged_layout.py (vLLM's paged KV buffers as per-token K/V), config.py (kv_connector_extra_config).
Users name the stable paths vericache_connector.vllm_connector and
vericache_connector.vllm_proposer.CompressedKVProposer. Importing this package imports nothing of vLLM.
"""
