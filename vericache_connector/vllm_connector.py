"""VeriCacheConnector: vLLM KV connector (KVConnectorBase_V1) for a dual-copy remote prefix store.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "VeriCacheConnector",
        "kv_connector_module_path": "vericache_connector.vllm_connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"store": "redis://127.0.0.1:6379/0", "compressor": "kivi4"}}'

SAVE: once a request's prompt has been computed, every whole chunk (256 tokens, a multiple of the
block size) of it is copied out of vLLM's paged blocks and written to the store twice: the full copy
per chunk and one compressed copy of the whole stored prefix (storage_backends.DualCopyStore; payloads
first, manifests last, so a half-written prefix is invisible). The write runs on a background loop.

LOAD (scheduler: get_num_new_matched_tokens; worker: start_load_kv): a prompt whose leading chunks are
stored is loaded asynchronously - vLLM keeps it waiting until get_finished reports it. Compressed
first: the worker fetches the small compressed copy, posts it to the VeriCache proposer (if vLLM runs
one, see vllm_proposer.py) which starts drafting at once, then streams the full copy layer by layer into
the request's blocks. Anything that goes wrong is reported through get_block_ids_with_load_errors, so
vLLM recomputes those blocks: a store fault never fails a request, and never changes its output.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.logger import init_logger
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)

from storage_backends import redact_url

from .compressors import LayeredKV, PrefixKV, get_compressor
from .store_client import StoreClient
from .vllm_config import load_connector_config
from .vllm_paged import gather_tokens, kv_views, layer_index, scatter_tokens

logger = init_logger("vllm.vericache")  # under vLLM's logging config, so its lines show in the server log


@dataclass
class LoadSpec:
    req_id: str
    prefix: list[int]        # the stored tokens to load (chunk-aligned)
    block_ids: list[int]     # the request's blocks, from token 0
    start: int               # tokens already computed locally (vLLM's prefix cache): load from here
    prompt: list[int]        # the whole prompt (for the pre-draft)


@dataclass
class SaveSpec:
    req_id: str
    prefix: list[int]
    block_ids: list[int]
    overwrite: bool = False  # a load of this prefix failed: rewrite the full copy


@dataclass
class VeriCacheMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class _Pending:  # scheduler side: a request whose prompt is not yet saved
    prompt: list[int]
    stored: int
    block_ids: list[int]
    overwrite: bool = False


class VeriCacheConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None, **kwargs: Any):
        super().__init__(vllm_config, role, kv_cache_config)
        tc = vllm_config.kv_transfer_config
        self.cfg = load_connector_config(tc.kv_connector_extra_config)
        if getattr(tc, "kv_load_failure_policy", "recompute") != "recompute" and role == KVConnectorRole.SCHEDULER:
            logger.warning("kv_load_failure_policy is %r: a store fault during a load fails the request; set "
                           "\"kv_load_failure_policy\": \"recompute\" in --kv-transfer-config to recompute instead",
                           tc.kv_load_failure_policy)
        self.block_size = vllm_config.cache_config.block_size
        if self.cfg.chunk_size % self.block_size:
            raise ValueError(f"chunk_size {self.cfg.chunk_size} must be a multiple of vLLM's block size "
                             f"{self.block_size}")
        self.compressor = get_compressor(self.cfg.compressor)
        if self.compressor.needs_queries:
            raise ValueError(f"compressor {self.cfg.compressor!r} needs the prompt's attention queries, which "
                             f"vLLM does not hand to connectors; use a query-free one (kivi4, int8, fp8, "
                             f"turboquant-k4v3, streamingllm-4x, knorm-4x)")
        mc = vllm_config.model_config
        self.num_kv_heads = mc.get_num_kv_heads(vllm_config.parallel_config)
        self.head_dim = mc.get_head_size()
        model_name = self.cfg.model_name or os.path.basename(os.path.normpath(str(mc.model)))
        self.client = StoreClient(self.cfg, model_name, mc.dtype, f"vericache-{role.name.lower()}")
        self.store = self.client.store
        # scheduler side
        self._lookups: dict[str, int] = {}          # req_id -> stored tokens to load
        self._loads: dict[str, LoadSpec] = {}
        self._pending: dict[str, _Pending] = {}
        self._loaded: set[str] = set()              # loaded requests are not saved again
        self._repair: set[str] = set()              # their load failed: save (overwrite) after computing
        # worker side
        self._views: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._lock = threading.Lock()
        self._done_loading: set[str] = set()
        self._failed_blocks: set[int] = set()
        logger.info("VeriCacheConnector (%s): store %s, compressor %s, chunk %d", role.name, redact_url(self.cfg.url),
                    self.cfg.compressor, self.cfg.chunk_size)

    # ============================== scheduler side ==============================
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        prompt = list(request.prompt_token_ids or [])
        stored = (len(prompt) - 1) // self.cfg.chunk_size * self.cfg.chunk_size
        if stored <= num_computed_tokens:
            return 0, False
        if request.request_id in self._loaded:  # asked again: its load failed; compute, then rewrite
            self._loaded.discard(request.request_id)
            self._repair.add(request.request_id)
            return 0, False
        try:
            found = self.client.call(self.store.lookup(prompt[:stored]))
        except Exception as e:  # down or slow: a miss (recompute), never a failed request
            logger.warning("store lookup failed for %s (%s: %s): computing the prompt", request.request_id,
                           type(e).__name__, e)
            return 0, False
        if found <= num_computed_tokens:
            return 0, False
        self._lookups[request.request_id] = found
        return found - num_computed_tokens, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        rid = request.request_id
        prompt = list(request.prompt_token_ids or [])
        if num_external_tokens > 0 and rid in self._lookups:
            found = self._lookups.pop(rid)
            self._loads[rid] = LoadSpec(rid, prompt[:found], list(blocks.get_block_ids()[0]),
                                        found - num_external_tokens, prompt)
            self._loaded.add(rid)
            return
        stored = (len(prompt) - 1) // self.cfg.chunk_size * self.cfg.chunk_size
        if stored > 0 and rid not in self._pending and rid not in self._loaded:
            self._pending[rid] = _Pending(prompt, stored, [], overwrite=rid in self._repair)
            self._repair.discard(rid)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = VeriCacheMetadata(loads=list(self._loads.values()))
        self._loads.clear()
        progress: dict[str, tuple[int, list[int] | None]] = {}
        for r in scheduler_output.scheduled_new_reqs:
            progress[r.req_id] = (r.num_computed_tokens, list(r.block_ids[0]))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids and rid in self._pending:  # preempted: all blocks are new
                self._pending[rid].block_ids = []
            progress[rid] = (cached.num_computed_tokens[i], list(new[0]) if new else None)
        for rid, (computed, new_blocks) in progress.items():
            p = self._pending.get(rid)
            if p is None:
                continue
            if new_blocks:
                p.block_ids.extend(new_blocks)
            if computed + scheduler_output.num_scheduled_tokens.get(rid, 0) >= p.stored:
                meta.saves.append(SaveSpec(rid, p.prompt[:p.stored], p.block_ids[:p.stored // self.block_size],
                                           p.overwrite))
                del self._pending[rid]
        return meta

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        for d in (self._pending, self._lookups):
            d.pop(request.request_id, None)
        self._loaded.discard(request.request_id)
        self._repair.discard(request.request_id)
        return False, None

    # ============================== worker side ==============================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        first = next(iter(kv_caches.values()))
        if first.device.type == "cpu":  # the key layout of vLLM's CPU attention depends on its ISA
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
            isa = _get_attn_isa(first.dtype, self.block_size, self.head_dim)
            if isa != "vec":
                raise ValueError(f"VeriCacheConnector reads vLLM's CPU KV cache in the 'vec' layout; this "
                                 f"machine uses {isa!r} (dtype {first.dtype}, block size {self.block_size})")
        named = sorted((layer_index(n, i), t) for i, (n, t) in enumerate(kv_caches.items()))
        self._views = [kv_views(t, self.num_kv_heads, self.head_dim) for _, t in named]

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for spec in meta.loads:
            self.client.submit(self._load(spec))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: the request waits until get_finished reports it

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # saved whole in wait_for_save, once the forward has written every layer

    def wait_for_save(self):
        if not self.has_connector_metadata():
            return
        for spec in self._get_connector_metadata().saves:
            ids = torch.tensor(spec.block_ids, device=self._views[0][0].device)
            n = len(spec.prefix)
            keys = [gather_tokens(k, ids, n).cpu() for k, _ in self._views]   # copies: blocks may be reused
            values = [gather_tokens(v, ids, n).cpu() for _, v in self._views]
            self.client.submit(asyncio.to_thread(self._compress_and_save, spec, keys, values))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        with self._lock:
            done, self._done_loading = self._done_loading, set()
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def shutdown(self):
        self.client.close()

    # ---- the work, on the store loop ----
    def _compress_and_save(self, spec: SaveSpec, keys, values) -> None:
        t0 = time.perf_counter()
        comp = self.compressor.compress(PrefixKV([k.float() for k in keys], [v.float() for v in values]))
        from .vllm_proposer import BOARD
        BOARD.post(spec.prefix, comp)
        layers = [{"k": k, "v": v} for k, v in zip(keys, values)]
        try:
            res = self.client.call(self.store.put_prefix(spec.prefix, layers, {comp.spec: comp.to_payload()},
                                                         overwrite=spec.overwrite),
                                   timeout=max(30.0, self.cfg.timeout_s))
            logger.info("saved %s: %d tokens, %d %sfull chunks, %d compressed bytes in %.2fs", spec.req_id,
                        len(spec.prefix), res.full_chunks_written, "rewritten " if spec.overwrite else "new ",
                        sum(res.compressed_bytes.values()),
                        time.perf_counter() - t0)
        except Exception as e:  # the request is answered anyway; the next one recomputes
            logger.warning("save of %s failed (%s: %s)", spec.req_id, type(e).__name__, e)

    async def _load(self, spec: LoadSpec) -> None:
        """Compressed copy -> the proposer (it drafts at once), full copy -> the request's blocks, both at
        the same time; then report the request done (and its blocks, if the full copy failed)."""
        t0, n = time.perf_counter(), len(spec.prefix)
        first, last = spec.start // self.block_size, n // self.block_size
        ids = torch.tensor(spec.block_ids[first:last])
        loaded, when = threading.Event(), {}
        drafting = asyncio.ensure_future(self._post_compressed(spec, loaded, when, t0))
        try:
            got_layers = 0
            async with contextlib.aclosing(self.store.stream_full(spec.prefix)) as layers:
                while True:
                    try:
                        layer, k, v = await asyncio.wait_for(anext(layers), self.cfg.timeout_s)
                    except StopAsyncIteration:
                        break
                    kv, vv = self._views[layer]
                    lo = first * self.block_size
                    scatter_tokens(kv, ids, k[:, lo:n])
                    scatter_tokens(vv, ids, v[:, lo:n])
                    got_layers += 1
            if got_layers != len(self._views):
                raise RuntimeError(f"full copy has {got_layers} layers, the model {len(self._views)}")
            logger.info("hit %s: %d tokens loaded (compressed copy after %s, full after %.2fs)", spec.req_id,
                        n - spec.start, f"{when['compressed']:.2f}s" if "compressed" in when else "-",
                        time.perf_counter() - t0)
        except BaseException as e:  # noqa: BLE001 - vLLM recomputes the blocks
            logger.warning("load of %s failed (%s: %s): vLLM recomputes its %d blocks", spec.req_id,
                           type(e).__name__, e, len(ids))
            with self._lock:
                self._failed_blocks.update(spec.block_ids[first:last])
        finally:
            loaded.set()
            with self._lock:
                self._done_loading.add(spec.req_id)
            await asyncio.gather(drafting, return_exceptions=True)

    async def _post_compressed(self, spec: LoadSpec, loaded: threading.Event, when: dict, t0: float) -> None:
        """Fetch the compressed copy and hand it to the proposer, which pre-drafts until `loaded`. A missing
        or broken copy only costs the drafts: vLLM decodes without them."""
        from .vllm_proposer import BOARD
        if BOARD.drafter is None:
            return
        try:
            got = await asyncio.wait_for(self.store.get_compressed(spec.prefix, self.compressor.spec),
                                         self.cfg.timeout_s)
            if got is not None:
                when["compressed"] = time.perf_counter() - t0
                await asyncio.to_thread(BOARD.post, spec.prefix, LayeredKV.from_payload(*got), spec.prompt, loaded)
        except Exception as e:  # noqa: BLE001
            logger.warning("compressed copy of %s unusable (%s: %s): no drafts for it", spec.req_id,
                           type(e).__name__, e)
