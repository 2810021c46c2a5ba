"""The connector's drafter role ("role": "drafter"): a vLLM server whose output is DRAFTS, never answers.

A drafter-role server sits far from the store (slow link). For a prompt with a stored prefix it loads ONLY
the compressed copy, decodes it (a quantizer's copy holds every token: its dequantized K/V take the place
of the full KV in vLLM's own blocks) and decodes on it at vLLM speed; it never reads the full copy and never
writes to the store (its KV is lossy). `vericache router` checks what it drafts against a verifier server
beside the store, so what a user sees is the verifier's output. Lossy output must not reach a user by
mistake: config.check_drafter_server refuses to start such a server unless the router token is set, its
command line names the RouterOnly middleware (router_plugins.py) and the compressor keeps every token.
"""

from __future__ import annotations

import asyncio
import time

import torch
from vllm.logger import init_logger

from ....compressors import LayeredKV
from .metadata import LoadSpec, VeriCacheMetadata
from .paged_layout import scatter_tokens
from .scheduler import VeriCacheConnectorScheduler, connector_off
from .worker import VeriCacheConnectorWorker

logger = init_logger("vllm.vericache")
MAX_CANDIDATES = 32  # chunk-aligned prefixes tried per lookup, longest first


class DrafterScheduler(VeriCacheConnectorScheduler):
    """Loads the longest stored prefix that has a compressed copy; never saves (its KV is lossy)."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        rid, prompt = request.request_id, list(request.prompt_token_ids or [])
        if self._loaded.pop(rid, None) is not None or connector_off(request):  # asked again: its load failed
            return 0, False
        stored = self.stored_len(prompt)
        lengths, copy = range(stored, num_computed_tokens, -self.cfg.chunk_size), self.compressor.spec
        try:
            for n in list(lengths)[:MAX_CANDIDATES]:
                if self.client.call(self.client.store.has_compressed(prompt[:n], copy)):
                    self._lookups[rid] = n
                    return n - num_computed_tokens, True
        except Exception as e:  # down or slow: a miss (vLLM computes the prompt), never a failed request
            logger.warning("store lookup failed for %s (%s: %s): computing the prompt", rid, type(e).__name__, e)
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        rid = request.request_id
        if num_external_tokens > 0 and rid in self._lookups:
            found = self._lookups.pop(rid)
            prompt = list(request.prompt_token_ids or [])
            block_ids = list(blocks.get_block_ids()[0])
            self._loads[rid] = LoadSpec(rid, prompt[:found], block_ids, found - num_external_tokens, prompt)
            self._loaded[rid] = found

    def build_connector_meta(self, scheduler_output) -> VeriCacheMetadata:
        meta = VeriCacheMetadata(loads=list(self._loads.values()))
        self._loads.clear()
        for r in scheduler_output.scheduled_new_reqs:  # a load that failed past a valid part: nothing to repair
            if r.num_computed_tokens < self._loaded.get(r.req_id, 0):
                del self._loaded[r.req_id]
        return meta


class DrafterWorker(VeriCacheConnectorWorker):
    """Loads the compressed copy, decoded, into the request's blocks; never the full copy, never saves."""

    def wait_for_save(self, meta: VeriCacheMetadata) -> None:
        if meta.saves:  # DrafterScheduler sends none; lossy KV must never reach the store
            logger.error("drafter role: %d saves dropped (lossy KV is never stored)", len(meta.saves))

    async def _load(self, spec: LoadSpec, idle: bool = True) -> None:  # the worker's signature; idle unused here
        t0, n = time.perf_counter(), len(spec.prefix)
        first, last = spec.start // self.block_size, n // self.block_size
        ids = torch.tensor(spec.block_ids[first:last])
        lo = first * self.block_size
        try:
            got = await asyncio.wait_for(
                self.client.store.get_compressed(spec.prefix, self.compressor.spec), self.cfg.timeout_s
            )
            if got is None:
                raise LookupError("the compressed copy is gone")
            fetched = time.perf_counter() - t0
            comp = LayeredKV.from_payload(*got)  # checksums passed; it must also fit the model
            self.compressor.validate(comp, n, len(self._views), self.num_kv_heads, self.head_dim)
            await asyncio.to_thread(self._put, comp, ids, lo, n)
            logger.info(
                "drafter: %s: compressed copy of %d tokens loaded (%d bytes in %.2fs, into blocks after %.2fs); "
                "the full copy is never read",
                spec.req_id,
                n - spec.start,
                comp.nbytes,
                fetched,
                time.perf_counter() - t0,
            )
        except BaseException as e:  # noqa: BLE001 - vLLM computes the blocks instead
            logger.warning(
                "drafter: compressed load of %s failed (%s: %s): vLLM computes its %d blocks",
                spec.req_id,
                type(e).__name__,
                e,
                len(ids),
            )
            with self._lock:
                self._failed_blocks.update(spec.block_ids[first:last])
        finally:
            self._load_ended(spec.req_id)

    def _put(self, comp: LayeredKV, ids: torch.Tensor, lo: int, n: int) -> None:
        for layer, (kv, vv) in enumerate(self._views):
            k, v = comp.layer_kv(layer, kv.dtype)  # [H_kv, n, D]: every token, dequantized
            if k.shape[1] != n or v.shape[1] != n:
                raise ValueError(f"compressed copy layer {layer} holds {k.shape[1]} of {n} tokens")
            scatter_tokens(kv, ids, k[:, lo:n])
            scatter_tokens(vv, ids, v[:, lo:n])
