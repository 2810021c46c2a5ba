"""The connector's drafter role ("role": "drafter"): a vLLM server whose output is DRAFTS, never answers.

A drafter-role server sits far from the store (slow link). For a prompt with a stored prefix it loads ONLY
the compressed copy, decodes it (a quantizer's copy holds every token: its dequantized K/V take the place
of the full KV in vLLM's own blocks) and decodes on it at vLLM speed; it never reads the full copy and never
writes to the store (its KV is lossy). `vericache router` checks what it drafts against a verifier server
beside the store, so what a user sees is the verifier's output. Lossy output must not reach a user by
mistake: config.check_drafter_server refuses to start such a server unless the router token is set, its
command line names the RouterOnly middleware (router_plugins.py) and the compressor keeps every token.

Its scheduler half is DrafterScheduler (below); its worker half is the connector's own worker, whose load strategy
for this role is loads.CompressedOnlyLoad (the copy, decoded into the request's blocks) and which refuses saves.
"""

from __future__ import annotations

from vllm.logger import init_logger

from .metadata import LoadSpec, VeriCacheMetadata
from .scheduler import VeriCacheConnectorScheduler, connector_off

logger = init_logger("vllm.vericache")
MAX_CANDIDATES = 32  # chunk-aligned prefixes tried per lookup, longest first


class DrafterScheduler(VeriCacheConnectorScheduler):
    """Loads the longest stored prefix that has a compressed copy; never saves (its KV is lossy)."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        rid, prompt = request.request_id, list(request.prompt_token_ids or [])
        req = self._request(rid)
        loaded, req.loaded = req.loaded, None
        if loaded is not None or connector_off(request):  # asked again: its load failed
            return 0, False
        stored = self.stored_len(prompt)
        lengths, copy = range(stored, num_computed_tokens, -self.cfg.chunk_size), self.compressor.spec
        try:
            for n in list(lengths)[:MAX_CANDIDATES]:
                if self.client.call(self.client.store.has_compressed(prompt[:n], copy)):
                    req.lookup = n
                    return n - num_computed_tokens, True
        except Exception as e:  # down or slow: a miss (vLLM computes the prompt), never a failed request
            logger.warning("store lookup failed for %s (%s: %s): computing the prompt", rid, type(e).__name__, e)
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        rid = request.request_id
        req = self._request(rid)
        if num_external_tokens > 0 and req.lookup is not None:
            found, req.lookup = req.lookup, None
            prompt = list(request.prompt_token_ids or [])
            block_ids = list(blocks.get_block_ids()[0])
            self._loads[rid] = LoadSpec(rid, prompt[:found], block_ids, found - num_external_tokens, prompt)
            req.loaded = found

    def build_connector_meta(self, scheduler_output) -> VeriCacheMetadata:
        meta = VeriCacheMetadata(loads=list(self._loads.values()))
        self._loads.clear()
        for r in scheduler_output.scheduled_new_reqs:  # a load that failed past a valid part: nothing to repair
            req = self._requests.get(r.req_id)
            if req is not None and r.num_computed_tokens < (req.loaded or 0):
                req.loaded = None
        return meta
