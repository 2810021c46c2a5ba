"""The connector's worker side (each vLLM worker process): KV moves between vLLM's paged blocks and
the store.

SAVE (wait_for_save): the whole chunks of a computed prompt are copied out of its blocks and written
on the store loop: the full copy per chunk and one compressed copy of the whole stored prefix
(payloads first, manifests last; split16 also stores the lower halves). LOAD (start_load_kv): each
LoadSpec goes to the server's load strategy (loads.py), chosen once from the spec: the full copy streamed
layer by layer into the request's blocks (store.full_copy) with the compressed copy fetched beside it for the
proposer, which drafts at once; split16's halves, upper first (split_load.py); or, on the drafter role, the
compressed copy alone (and no saves). A prefix vLLM computes instead of loading still gets its compressed copy
for the proposer (DraftFetch). A compressed copy that does not fit the model or its own meta
(Compressor.validate) is not handed over: no drafts, the output is vLLM's anyway. A failed load reports its
blocks through get_block_ids_with_load_errors and vLLM recomputes them.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict

import torch
from vllm.logger import init_logger

from storage_backends import StoreError, StoreUnavailable

from ....compressors import PrefixKV
from ....compressors.split16 import Split16Compressor
from ....store.client import StoreClient
from ..handoff import DraftHandoff
from .config import ConnectorSpec
from .load_plan import LinkMeter
from .loads import CompressedOnlyLoad, DraftFetch, FullCopyLoad, LoadContext, LoadStrategy
from .metadata import SaveSpec, VeriCacheMetadata, VeriCacheWorkerMeta
from .paged_layout import gather_tokens, kv_views, layer_index
from .split_load import Split16Load
from .stats import StatsRecorder

logger = init_logger("vllm.vericache")
SAVE_TIMEOUT_S = 30.0  # a whole prefix written (at least the store timeout)
# A step without a forward (every request waits for its KV) waits up to this long for a load to end before it
# answers: vLLM repeats such steps back to back, and each one takes the worker's GIL and a core from the load
# and the pre-draft. A load that ends wakes it at once; a request that arrives meanwhile waits at most this.
IDLE_WAIT_S = 0.02
MAX_REPAIRS = 1024  # failed loads whose repair save is still to come (one that never comes is forgotten)
TRANSIENT = (StoreUnavailable, TimeoutError, ConnectionError, asyncio.CancelledError)  # the store's, not the data's


def broken_chunks(error: BaseException) -> set[int] | None:
    """What a failed load found broken in the store: the first tokens of the full-copy chunks to rewrite (none
    after a stall or a dropped link: the stored copy is intact), or None where it cannot say (rewrite it all)."""
    if isinstance(error, TRANSIENT):
        return set()
    if isinstance(error, StoreError) and error.chunk_start is not None:
        return {error.chunk_start}
    return None


def load_strategy(spec: ConnectorSpec, ctx: LoadContext) -> LoadStrategy:
    """How this server loads a stored prefix, from its spec: the drafter role the compressed copy alone, split16
    its halves, every other compressor the full copy."""
    if spec.drafter:
        return CompressedOnlyLoad(ctx)
    if isinstance(spec.compressor, Split16Compressor):
        return Split16Load(ctx)
    return FullCopyLoad(ctx)


class VeriCacheConnectorWorker:
    def __init__(
        self,
        spec: ConnectorSpec,
        num_kv_heads: int,
        head_dim: int,
        client: StoreClient,
        handoff: DraftHandoff | None,
    ):
        self.cfg, self.block_size, self.compressor, self.client = spec.cfg, spec.block_size, spec.compressor, client
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.split = isinstance(self.compressor, Split16Compressor)  # the compressed copy is half of the full
        self.drafter = spec.drafter  # its KV is lossy: never saved
        self.handoff = handoff
        self._lock = threading.Condition()
        self._done_loading: set[str] = set()
        self._loading = 0  # loads in flight
        self._idle_step = False  # the step being run has no forward (its metadata says)
        self._failed_blocks: set[int] = set()
        self._broken: OrderedDict[str, set[int] | None] = OrderedDict()  # req_id -> what its failed load found
        self.meter = LinkMeter()  # what the loads move, reported to the scheduler side each step
        self._forward_t0: float | None = None  # this step's forward started (reported with the link's progress)
        self.stats = StatsRecorder()  # get_kv_connector_stats (stats.py)
        self.ctx = LoadContext(
            spec.cfg,
            spec.block_size,
            num_kv_heads,
            head_dim,
            client,
            spec.compressor,
            handoff,
            self.meter,
            self.stats,
            load_ended=self._load_ended,
            load_failed=self._load_failed,
        )
        self.loads = load_strategy(spec, self.ctx)
        self.drafts = DraftFetch(self.ctx)  # compressed copies of the prefixes vLLM computes, for the proposer

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        first = next(iter(kv_caches.values()))
        if self.split and first.dtype != torch.float32:
            raise ValueError(
                f"compressor {self.cfg.compressor!r} splits float32 KV in two halves; this server's KV cache is "
                f"{first.dtype} (its upper half would be the whole KV): use int8, fp8 or kivi4"
            )
        if first.device.type == "cpu":  # the key layout of vLLM's CPU attention depends on its ISA
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            isa = _get_attn_isa(first.dtype, self.block_size, self.head_dim)
            if isa != "vec":
                raise ValueError(
                    f"VeriCacheConnector reads vLLM's CPU KV cache in the 'vec' layout; this "
                    f"machine uses {isa!r} (dtype {first.dtype}, block size {self.block_size})"
                )
        named = sorted((layer_index(n, i), t) for i, (n, t) in enumerate(kv_caches.items()))
        self.ctx.views = [kv_views(t, self.num_kv_heads, self.head_dim) for _, t in named]
        self._token_bytes = 2 * len(self.ctx.views) * self.num_kv_heads * self.head_dim * first.element_size()

    def forward_started(self) -> None:
        """vLLM bound this step's metadata: its forward runs next (build_connector_worker_meta comes after it)."""
        self._forward_t0 = time.perf_counter()

    def start_load_kv(self, meta: VeriCacheMetadata) -> None:
        with self._lock:
            self._loading += len(meta.loads)
            self._idle_step = meta.idle
        if meta.seeded and self.handoff is not None:
            self.handoff.mark_seeded(meta.seeded)
        for spec in meta.loads:
            self.client.submit(self.loads.load(spec, meta.idle))
        for spec in meta.drafts_only:  # computed here, not loaded: the proposer drafts on the compressed copy
            fresh = self.handoff is not None and not self.handoff.has(spec.prefix)
            # only on an idle link, and where the proposer's drafts after the load could pay at its batch size
            if fresh and not self.handoff.seeded(spec.prompt) and not self._loading and self._wants_copy():
                self.client.submit(self.drafts.fetch(spec))

    def _wants_copy(self) -> bool:
        return self.handoff.pacing.drafts_could_pay()

    def _load_ended(self, req_id: str) -> None:
        """A load is over (loaded or failed): get_finished reports it, and an idle step waits on it no more."""
        with self._lock:
            self._done_loading.add(req_id)
            self._loading -= 1
            self._lock.notify_all()

    def _load_failed(self, block_ids: list[int], req_id: str, error: BaseException) -> None:
        """A load failed: get_block_ids_with_load_errors reports its blocks, and vLLM recomputes them; the
        request's repair save rewrites what the load found broken (broken_chunks), nothing more."""
        with self._lock:
            self._failed_blocks.update(block_ids)
            self._broken[req_id] = broken_chunks(error)
            while len(self._broken) > MAX_REPAIRS:
                self._broken.popitem(last=False)

    def take_stats(self):
        self.stats.proposer(self.handoff.drafter if self.handoff is not None else None)
        return self.stats.take()

    def worker_meta(self) -> VeriCacheWorkerMeta:
        nbytes, busy = self.meter.take()
        value = None if self.handoff is None else self.handoff.pacing.predraft_value()
        # vLLM asks right after its forward (before sampling and a proposer's drafting; its connector calls
        # start_load_kv and, unless a speculative config defers it, wait_for_save after the forward too)
        forward_s = None if self._forward_t0 is None else time.perf_counter() - self._forward_t0
        self._forward_t0 = None
        return VeriCacheWorkerMeta(nbytes / self._token_bytes if self.ctx.views else 0.0, busy, value, forward_s)

    def wait_for_save(self, meta: VeriCacheMetadata) -> None:
        if self.drafter:
            if meta.saves:  # DrafterScheduler sends none; lossy KV must never reach the store
                logger.error("drafter role: %d saves dropped (lossy KV is never stored)", len(meta.saves))
            return
        views = self.ctx.views
        for spec in meta.saves:
            ids = torch.tensor(spec.block_ids, device=views[0][0].device)
            n = len(spec.prefix)
            keys = [gather_tokens(k, ids, n).cpu() for k, _ in views]  # copies: blocks may be reused
            values = [gather_tokens(v, ids, n).cpu() for _, v in views]
            self.client.submit(asyncio.to_thread(self._compress_and_save, spec, keys, values))

    def get_finished(self) -> set[str] | None:
        with self._lock:
            if self._idle_step and self._loading and not self._done_loading:  # IDLE_WAIT_S
                self._lock.wait(IDLE_WAIT_S)
            self._idle_step = False
            done, self._done_loading = self._done_loading, set()
        return done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # ---- the work, on the store loop ----
    def _compress_and_save(self, spec: SaveSpec, keys, values) -> None:
        t0 = time.perf_counter()
        pre = PrefixKV([k.float() for k in keys], [v.float() for v in values])
        # split16 also stores the lower halves: with the compressed copy, the full KV (the proposer's load path)
        comp, *rest = self.compressor.halves(pre) if self.split else (self.compressor.compress(pre),)
        if self.handoff is not None:
            self.handoff.post(spec.prefix, comp)
        layers = [{"k": k, "v": v} for k, v in zip(keys, values)]
        copies = {c.spec: c.to_payload() for c in (comp, *rest)}
        # a repair rewrites what its failed load found broken (all of it where that is unknown); after a lookup
        # found chunks gone, the chunks whose manifests are missing or corrupt (put_prefix checks them)
        with self._lock:
            broken = self._broken.pop(spec.req_id, set()) if spec.overwrite else set()
        try:
            res = self.client.call(
                self.client.store.put_prefix(
                    spec.prefix, layers, copies, overwrite=broken is None, rewrite=broken or ()
                ),
                timeout=max(SAVE_TIMEOUT_S, self.cfg.timeout_s),
            )
            self.stats.saved(res)
            logger.info(
                "saved %s: %d tokens, %d %sfull chunks, %d compressed bytes in %.2fs",
                spec.req_id,
                len(spec.prefix),
                res.full_chunks_written,
                "rewritten " if spec.overwrite else "new ",
                sum(res.compressed_bytes.values()),
                time.perf_counter() - t0,
            )
        except Exception as e:  # the request is answered anyway; the next one recomputes
            self.stats.count("store_errors", "save")
            logger.warning("save of %s failed (%s: %s)", spec.req_id, type(e).__name__, e)
