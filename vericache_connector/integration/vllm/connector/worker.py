"""The connector's worker side (each vLLM worker process): KV moves between vLLM's paged blocks and
the store.

SAVE (wait_for_save): the whole chunks of a computed prompt are copied out of its blocks and written
on the store loop: the full copy per chunk and one compressed copy of the whole stored prefix
(payloads first, manifests last). LOAD (start_load_kv): compressed copy first (handed to the proposer,
which drafts at once), while the full copy streams layer by layer into the request's blocks
(remote.full_copy, the same loop the engine's prefix cache uses). With the lossless split compressor
(compressors/split16.py) and the proposer running, the compressed copy IS the upper half of the full
copy: the load streams it, posts it, then streams the lower half right behind it on the link, joining
and putting each layer as it lands (the full copy's bytes cross the link once; the pre-drafts start
halfway; the first token waits for no more than the last layer's join). A compressed copy that does not fit
the model or its own meta (Compressor.validate) is not handed over: no drafts, the output is vLLM's
anyway. A failed load reports its blocks through get_block_ids_with_load_errors and vLLM recomputes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time

import torch
from vllm.logger import init_logger

from ....compressors import LayeredKV, PrefixKV
from ....compressors.split16 import COMPLEMENT, Split16Compressor, digest
from ....store.client import StoreClient
from ....store.full_copy import stream_full_copy
from ..handoff import Deferred, DraftHandoff
from .config import ConnectorSpec
from .load_plan import LinkMeter
from .metadata import LoadSpec, SaveSpec, VeriCacheMetadata, VeriCacheWorkerMeta
from .paged_layout import gather_tokens, kv_views, layer_index, scatter_tokens
from .stats import StatsRecorder

logger = init_logger("vllm.vericache")
SAVE_TIMEOUT_S = 30.0  # a whole prefix written (at least the store timeout)
PROBE_LAYERS = 5  # the first split load measures the link on this many layers of the upper halves
# A step without a forward (every request waits for its KV) waits up to this long for a load to end before it
# answers: vLLM repeats such steps back to back, and each one takes the worker's GIL and a core from the load
# and the pre-draft. A load that ends wakes it at once; a request that arrives meanwhile waits at most this.
IDLE_WAIT_S = 0.02


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
        self.handoff = handoff
        self._views: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._lock = threading.Condition()
        self._done_loading: set[str] = set()
        self._loading = 0  # loads in flight
        self._idle_step = False  # the step being run has no forward (its metadata says)
        self._failed_blocks: set[int] = set()
        self._compressed_s_per_token: float | None = None  # a compressed copy's measured fetch time per token
        self.meter = LinkMeter()  # what the loads move, reported to the scheduler side each step
        self._forward_t0: float | None = None  # this step's forward started (reported with the link's progress)
        self.stats = StatsRecorder()  # get_kv_connector_stats (stats.py)

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
        self._views = [kv_views(t, self.num_kv_heads, self.head_dim) for _, t in named]
        self._token_bytes = 2 * len(self._views) * self.num_kv_heads * self.head_dim * first.element_size()

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
            self.client.submit(self._load(spec, meta.idle))
        for spec in meta.drafts_only:  # computed here, not loaded: the proposer drafts on the compressed copy
            fresh = self.handoff is not None and not self.handoff.has(spec.prefix)
            # only on an idle link, and where the proposer's drafts after the load could pay at its batch size
            if fresh and not self.handoff.seeded(spec.prompt) and not self._loading and self._wants_copy():
                self.client.submit(self._fetch_for_drafts(spec))

    def _wants_copy(self) -> bool:
        return self.handoff.pacing.drafts_could_pay()

    def _load_ended(self, req_id: str) -> None:
        """A load is over (loaded or failed): get_finished reports it, and an idle step waits on it no more."""
        with self._lock:
            self._done_loading.add(req_id)
            self._loading -= 1
            self._lock.notify_all()

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
        return VeriCacheWorkerMeta(nbytes / self._token_bytes if self._views else 0.0, busy, value, forward_s)

    def wait_for_save(self, meta: VeriCacheMetadata) -> None:
        for spec in meta.saves:
            ids = torch.tensor(spec.block_ids, device=self._views[0][0].device)
            n = len(spec.prefix)
            keys = [gather_tokens(k, ids, n).cpu() for k, _ in self._views]  # copies: blocks may be reused
            values = [gather_tokens(v, ids, n).cpu() for _, v in self._views]
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
        try:
            res = self.client.call(
                self.client.store.put_prefix(spec.prefix, layers, copies, overwrite=spec.overwrite),
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

    async def _load(self, spec: LoadSpec, idle: bool = True) -> None:
        """Compressed copy -> the proposer (it drafts at once), full copy -> the request's blocks, both at
        the same time; then report the request done (and its blocks, if the full copy failed)."""
        t0, n = time.perf_counter(), len(spec.prefix)
        first, last = spec.start // self.block_size, n // self.block_size
        ids = torch.tensor(spec.block_ids[first:last])
        lo = first * self.block_size
        loaded, when, posts = threading.Event(), {}, []
        split = idle and self._split_load(n)  # vLLM busy with other requests: no pre-draft could run, and the
        # halves' joins and checks would take the cores from it (the full copy streams faster then)
        drafting = asyncio.ensure_future(self._post_compressed(spec, loaded, when, t0) if idle else asyncio.sleep(0))
        streamed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        cut = False  # the proposer's copy is cut from a streamed full copy (none posted for this prefix yet)

        def put(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            if not split:  # streamed whole (a split load's halves are counted as they arrive)
                self.meter.moved(k.nbytes + v.nbytes)
                self.stats.count("bytes_read", "full", n=k.nbytes + v.nbytes)
            kv, vv = self._views[layer]
            scatter_tokens(kv, ids, k[:, lo:n])
            scatter_tokens(vv, ids, v[:, lo:n])
            if cut:  # the full copy streamed: the proposer's copy is cut from it
                streamed[layer] = (k, v)

        self.meter.begin()
        try:
            split = split and await self._load_split(spec, put, loaded, when, t0, posts)
            if not split:
                cut = self._split_drafter and not self.handoff.has(spec.prefix)
                await stream_full_copy(
                    self.client.store,
                    spec.prefix,
                    len(self._views),
                    self.cfg.timeout_s,
                    put,
                    shape=(self.num_kv_heads, n, self.head_dim),
                )
                if self.split:  # the upper halves would have taken half as long: the next load's decision
                    self._learn_transfer((time.perf_counter() - t0) / 2 / n)
            self.stats.observe("load_seconds", time.perf_counter() - t0)
            logger.info(
                "hit %s: %d tokens loaded (compressed copy after %s, %sfull after %.2fs)",
                spec.req_id,
                n - spec.start,
                f"{when['compressed']:.2f}s" if "compressed" in when else "-",
                f"its lower halves after {when['lower halves']:.2f}s, " if "lower halves" in when else "",
                time.perf_counter() - t0,
            )
        except BaseException as e:  # noqa: BLE001 - vLLM recomputes the blocks
            self.stats.load_failed(e)
            logger.warning(
                "load of %s failed (%s: %s): vLLM recomputes its %d blocks", spec.req_id, type(e).__name__, e, len(ids)
            )
            with self._lock:
                self._failed_blocks.update(spec.block_ids[first:last])
        finally:
            self.meter.end()
            loaded.set()
            self._load_ended(spec.req_id)
            await asyncio.gather(drafting, *posts, return_exceptions=True)
        # split16 on a fast store: no compressed copy fetched; the proposer's is cut from the streamed KV, by
        # the proposer's draft-cache thread once the request runs (Deferred): not beside vLLM's first step
        if cut and len(streamed) == len(self._views):
            kv = [streamed[i] for i in range(len(self._views))]
            pre = PrefixKV([k for k, _ in kv], [v for _, v in kv])
            self.handoff.post(spec.prefix, Deferred(functools.partial(self.compressor.compress, pre)))

    def _split_load(self, n: int) -> bool:
        """Load split16's halves (hi first, for the proposer's pre-draft) instead of streaming the full copy:
        where the lower halves' transfer (as long as the upper halves', measured on earlier loads) leaves the
        pre-draft room for a few draft steps. On a fast store the split's sequential halves, their checks and
        the join would only delay the first token."""
        if not self._split_drafter:
            return False
        per_token = self._compressed_s_per_token
        return per_token is None or self.handoff.pacing.worth_predraft_during(per_token * n)

    @property
    def _split_drafter(self) -> bool:
        """split16 with the proposer: its compressed copy is fetched as half of the full copy or cut from the
        loaded KV, never fetched beside it (_post_compressed)."""
        return self.split and self.handoff is not None and self.handoff.pacing.attached

    def _learn_transfer(self, per_token: float) -> None:
        """A compressed copy's transfer time per token (EMA): what the next fetch decision weighs."""
        old = self._compressed_s_per_token
        self._compressed_s_per_token = per_token if old is None else 0.7 * old + 0.3 * per_token

    async def _load_split(
        self, spec: LoadSpec, put, loaded: threading.Event, when: dict, t0: float, posts: list
    ) -> bool:
        """split16 with the proposer: the upper halves (posted: the pre-draft starts on them), then the lower
        halves right behind them on the link, each layer joined bit for bit and put as it lands. False where
        there is no compressed copy of exactly this prefix, or a half is missing or does not fit (logged):
        the caller streams the full copy instead (over these blocks), so the output never depends on it.
        The post (the proposer builds its draft cache on a busy CPU: 0.35-0.6 s at concurrency 4-8 here) goes
        into `posts`, which the caller awaits after the load has ended: the request's KV is ready, and the link
        measured, when the last byte is in, not when the draft cache is."""
        comp = self.compressor
        hi, hi_digest = None, None
        hi_layers: list[dict] = []
        try:
            stream = self.client.store.stream_compressed(spec.prefix, [comp.spec, comp.spec + COMPLEMENT])
            async with contextlib.aclosing(stream) as layers:
                while (x := await _next_layer(layers, self.cfg.timeout_s)) is not None:
                    nbytes = sum(t.nbytes for t in x.tensors.values()) if x.tensors else 0
                    self.meter.moved(nbytes)
                    self.stats.count("bytes_read", "compressed", n=nbytes)  # split16's halves: both compressed
                    if x.copy == 0:  # the upper halves: whole before anything is drafted on them
                        hi_layers.append(x.tensors)
                        if x.index == 1:
                            second = time.perf_counter()
                        elif x.index == min(PROBE_LAYERS, x.count - 1) > 1 and self._compressed_s_per_token is None:
                            per_layer = (time.perf_counter() - second) / (x.index - 1)
                            if not self._worth_split(spec, per_layer * x.count):
                                return False  # a fast store, seen on the first load: the full copy is streamed
                        if x.index == x.count - 1:
                            hi, hi_digest, posting = self._got_upper_halves(spec, x.meta, hi_layers, loaded, when, t0)
                            posts.append(posting)
                        continue
                    if hi is None:
                        raise ValueError("the upper halves ended early")
                    if x.index == 0:  # the header's meta; its bytes are checked with the whole complement's
                        comp.check_complement(hi, x.meta, x.count, await hi_digest)
                    if x.index == x.count - 1:  # every byte is here: the pre-draft stops, the last joins go on
                        when["lower halves"] = time.perf_counter() - t0
                        loaded.set()
                    await asyncio.to_thread(put, x.index, *comp.join_layer(hi, x.index, x.tensors))
            if hi is None:  # no compressed copy of exactly this prefix (chunks of a longer one): no warning
                self.stats.miss("compressed")
                return False
            if "lower halves" not in when:
                raise ValueError("no lower halves streamed")
            return True
        except Exception as e:  # noqa: BLE001 - the full copy is streamed instead
            self.stats.miss("compressed", e)
            logger.warning(
                "split load of %s: %s: %s: streaming the full copy instead", spec.req_id, type(e).__name__, e
            )
            return False
        finally:
            if hi_digest is not None:
                await asyncio.gather(hi_digest, return_exceptions=True)

    def _worth_split(self, spec: LoadSpec, upper_s: float) -> bool:
        """The first load's decision (no transfer learned yet), from the upper halves' first layers (their
        rate after the first, which a link's burst may carry): upper_s, their expected transfer, learned;
        the split goes on where the pre-draft has room."""
        self._learn_transfer(upper_s / len(spec.prefix))
        if self.handoff.pacing.worth_predraft_during(upper_s):
            return True
        logger.info(
            "%s: the store is fast (~%.2fs for the upper halves): the full copy is streamed", spec.req_id, upper_s
        )
        return False

    def _got_upper_halves(self, spec: LoadSpec, meta: dict, layers: list[dict], loaded, when: dict, t0: float):
        """The upper halves are in: checked against the model, posted to the proposer (a pre-draft where the
        lower halves' transfer, as long as theirs, leaves room for it); their digest computed meanwhile."""
        hi = self._arrived(spec, LayeredKV.from_payload(meta, layers), when, t0)
        drafting = self.handoff.pacing.worth_predraft_during(when["compressed"])
        prompt = (spec.prompt, loaded) if drafting else ()  # else the proposer may draft on it once vLLM runs
        posting = asyncio.ensure_future(asyncio.to_thread(self.handoff.post, spec.prefix, hi, *prompt))
        return hi, asyncio.ensure_future(asyncio.to_thread(digest, layers)), posting

    async def _fetch_compressed(self, spec: LoadSpec, when: dict, t0: float) -> LayeredKV | None:
        """The compressed copy of exactly this prefix (None: none stored), _arrived."""
        got = await asyncio.wait_for(
            self.client.store.get_compressed(spec.prefix, self.compressor.spec), self.cfg.timeout_s
        )
        if got is None:
            self.stats.miss("compressed")
            return None
        comp = self._arrived(spec, LayeredKV.from_payload(*got), when, t0)
        self.stats.count("bytes_read", "compressed", n=comp.nbytes)
        return comp

    def _arrived(self, spec: LoadSpec, comp: LayeredKV, when: dict, t0: float) -> LayeredKV:
        """A compressed copy whose checksums passed, checked against the model too (ValueError); its arrival
        in when["compressed"], its transfer time learned for the next decision."""
        n = len(spec.prefix)
        self.compressor.validate(comp, n, len(self._views), self.num_kv_heads, self.head_dim)
        when["compressed"] = time.perf_counter() - t0
        self._learn_transfer(when["compressed"] / n)
        self.stats.count("hits", "compressed")
        return comp

    async def _fetch_for_drafts(self, spec: LoadSpec) -> None:
        """A prefix vLLM computes instead of loading: only its compressed copy comes, for the proposer to
        draft on once the request runs (no pre-draft: the CPU is computing). A missing or broken copy only
        costs the drafts."""
        self.meter.begin()
        try:
            comp = await self._fetch_compressed(spec, {}, time.perf_counter())
            if comp is not None:
                self.meter.moved(comp.nbytes)
                self.handoff.post(spec.prefix, comp)
        except Exception as e:  # noqa: BLE001
            self.stats.miss("compressed", e)
            logger.warning(
                "compressed copy of %s unusable (%s: %s): no drafts for it", spec.req_id, type(e).__name__, e
            )
        finally:
            self.meter.end()

    async def _post_compressed(self, spec: LoadSpec, loaded: threading.Event, when: dict, t0: float) -> None:
        """Fetch the compressed copy and hand it to the proposer, which pre-drafts until `loaded`. A missing
        or broken copy only costs the drafts: vLLM decodes without them."""
        if self.handoff is None or self._split_drafter or self.handoff.seeded(spec.prompt):  # no drafts for it
            return
        n = len(spec.prefix)
        expected_s = None if self._compressed_s_per_token is None else self._compressed_s_per_token * n
        if not self.handoff.pacing.worth_predraft(expected_s, spec.max_tokens):
            logger.info(
                "%s: compressed copy not fetched (~%.2fs on the link would delay the full copy by more than "
                "pre-drafts save)",
                spec.req_id,
                expected_s,
            )
            return
        try:
            comp = await self._fetch_compressed(spec, when, t0)
            if comp is not None:
                await asyncio.to_thread(self.handoff.post, spec.prefix, comp, spec.prompt, loaded)
        except Exception as e:  # noqa: BLE001
            self.stats.miss("compressed", e)
            logger.warning(
                "compressed copy of %s unusable (%s: %s): no drafts for it", spec.req_id, type(e).__name__, e
            )


async def _next_layer(layers, stall_s: float):
    """The next layer of a compressed-copy stream (None at its end); one that takes over stall_s: an error."""
    try:
        return await asyncio.wait_for(anext(layers), stall_s)
    except StopAsyncIteration:
        return None
