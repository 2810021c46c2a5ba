"""split16's load (loads.py's strategy for the lossless split compressor, compressors/split16.py).

With split16 and the proposer running, the compressed copy IS the upper half of the full copy: the load streams
it, posts it, then streams the lower half right behind it on the link, joining and putting each layer as it lands
(the full copy's bytes cross the link once; the pre-drafts start halfway; the first token waits for no more than
the last layer's join). Where the lower halves' transfer would leave the pre-draft no room (a fast store), or vLLM
is busy with other requests, the full copy is streamed as FullCopyLoad streams it, and the proposer's copy is cut
from it later (Deferred): no compressed copy is fetched beside it. Without the proposer it is a FullCopyLoad.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time

from vllm.logger import init_logger

from ....compressors import LayeredKV, PrefixKV
from ....compressors.split16 import COMPLEMENT, digest
from ..handoff import Deferred
from .loads import FullCopyLoad, LoadJob, arrived
from .metadata import LoadSpec

logger = init_logger("vllm.vericache")
PROBE_LAYERS = 5  # the first split load measures the link on this many layers of the upper halves


class _SplitJob(LoadJob):
    split = False  # split16's halves are loaded (else the full copy is streamed)
    kept: dict | None = None  # the streamed full copy's layers, the proposer's copy is cut from (none posted yet)


class Split16Load(FullCopyLoad):
    async def load(self, spec: LoadSpec, idle: bool) -> None:
        job = _SplitJob(spec, self.ctx.block_size)
        job.split = idle and self._split_load(job.n)  # vLLM busy with other requests: no pre-draft could run, and
        # the halves' joins and checks would take the cores from it (the full copy streams faster then)
        await self._run(job, idle)
        # split16 on a fast store: no compressed copy fetched; the proposer's is cut from the streamed KV, by
        # the proposer's draft-cache thread once the request runs (Deferred): not beside vLLM's first step
        views = self.ctx.views
        if job.kept is not None and len(job.kept) == len(views):
            kv = [job.kept[i] for i in range(len(views))]
            pre = PrefixKV([k for k, _ in kv], [v for _, v in kv])
            self.ctx.handoff.post(spec.prefix, Deferred(functools.partial(self.ctx.compressor.compress, pre)))

    async def _bring(self, job: _SplitJob) -> None:
        if job.split and await self._load_split(job):
            return
        if self._split_drafter and not self.ctx.handoff.has(job.spec.prefix):
            job.kept = {}  # the proposer's copy is cut from the streamed full copy (none posted for this prefix yet)
        await self._stream(job, job.kept)
        # the upper halves would have taken half as long: the next load's decision
        self.ctx.learn_transfer((time.perf_counter() - job.t0) / 2 / job.n)

    def _fetches_beside(self) -> bool:
        return not self._split_drafter

    def _split_load(self, n: int) -> bool:
        """Load split16's halves (hi first, for the proposer's pre-draft) instead of streaming the full copy:
        where the lower halves' transfer (as long as the upper halves', measured on earlier loads) leaves the
        pre-draft room for a few draft steps. On a fast store the split's sequential halves, their checks and
        the join would only delay the first token."""
        if not self._split_drafter:
            return False
        per_token = self.ctx.compressed_s_per_token
        return per_token is None or self.ctx.handoff.pacing.worth_predraft_during(per_token * n)

    @property
    def _split_drafter(self) -> bool:
        """split16 with the proposer: its compressed copy is fetched as half of the full copy or cut from the
        loaded KV, never fetched beside it (_post_compressed)."""
        return self.ctx.handoff is not None and self.ctx.handoff.pacing.attached

    async def _load_split(self, job: LoadJob) -> bool:
        """split16 with the proposer: the upper halves (posted: the pre-draft starts on them), then the lower
        halves right behind them on the link, each layer joined bit for bit and put as it lands. False where
        there is no compressed copy of exactly this prefix, or a half is missing or does not fit (logged):
        the caller streams the full copy instead (over these blocks), so the output never depends on it.
        The post (the proposer builds its draft cache on a busy CPU: 0.35-0.6 s at concurrency 4-8 here) goes
        into `job.posts`, which the caller awaits after the load has ended: the request's KV is ready, and the
        link measured, when the last byte is in, not when the draft cache is."""
        ctx, spec, comp = self.ctx, job.spec, self.ctx.compressor
        hi, hi_digest = None, None
        hi_layers: list[dict] = []
        try:
            stream = ctx.client.store.stream_compressed(spec.prefix, [comp.spec, comp.spec + COMPLEMENT])
            async with contextlib.aclosing(stream) as layers:
                while (x := await _next_layer(layers, ctx.cfg.timeout_s)) is not None:
                    nbytes = sum(t.nbytes for t in x.tensors.values()) if x.tensors else 0
                    ctx.meter.moved(nbytes)
                    ctx.stats.count("bytes_read", "compressed", n=nbytes)  # split16's halves: both compressed
                    if x.copy == 0:  # the upper halves: whole before anything is drafted on them
                        hi_layers.append(x.tensors)
                        if x.index == 1:
                            second = time.perf_counter()
                        elif x.index == min(PROBE_LAYERS, x.count - 1) > 1 and ctx.compressed_s_per_token is None:
                            per_layer = (time.perf_counter() - second) / (x.index - 1)
                            if not self._worth_split(spec, per_layer * x.count):
                                return False  # a fast store, seen on the first load: the full copy is streamed
                        if x.index == x.count - 1:
                            hi, hi_digest, posting = self._got_upper_halves(job, x.meta, hi_layers)
                            job.posts.append(posting)
                        continue
                    if hi is None:
                        raise ValueError("the upper halves ended early")
                    if x.index == 0:  # the header's meta; its bytes are checked with the whole complement's
                        comp.check_complement(hi, x.meta, x.count, await hi_digest)
                    if x.index == x.count - 1:  # every byte is here: the pre-draft stops, the last joins go on
                        job.when["lower halves"] = time.perf_counter() - job.t0
                        job.loaded.set()
                    await asyncio.to_thread(job.put, ctx.views, x.index, *comp.join_layer(hi, x.index, x.tensors))
            if hi is None:  # no compressed copy of exactly this prefix (chunks of a longer one): no warning
                ctx.stats.miss("compressed")
                return False
            if "lower halves" not in job.when:
                raise ValueError("no lower halves streamed")
            return True
        except Exception as e:  # noqa: BLE001 - the full copy is streamed instead
            ctx.stats.miss("compressed", e)
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
        self.ctx.learn_transfer(upper_s / len(spec.prefix))
        if self.ctx.handoff.pacing.worth_predraft_during(upper_s):
            return True
        logger.info(
            "%s: the store is fast (~%.2fs for the upper halves): the full copy is streamed", spec.req_id, upper_s
        )
        return False

    def _got_upper_halves(self, job: LoadJob, meta: dict, layers: list[dict]):
        """The upper halves are in: checked against the model, posted to the proposer (a pre-draft where the
        lower halves' transfer, as long as theirs, leaves room for it); their digest computed meanwhile."""
        spec, handoff = job.spec, self.ctx.handoff
        hi = arrived(self.ctx, spec, LayeredKV.from_payload(meta, layers), job.when, job.t0)
        drafting = handoff.pacing.worth_predraft_during(job.when["compressed"])
        prompt = (spec.prompt, job.loaded) if drafting else ()  # else the proposer may draft on it once vLLM runs
        posting = asyncio.ensure_future(asyncio.to_thread(handoff.post, spec.prefix, hi, *prompt))
        return hi, asyncio.ensure_future(asyncio.to_thread(digest, layers)), posting


async def _next_layer(layers, stall_s: float):
    """The next layer of a compressed-copy stream (None at its end); one that takes over stall_s: an error."""
    try:
        return await asyncio.wait_for(anext(layers), stall_s)
    except StopAsyncIteration:
        return None
