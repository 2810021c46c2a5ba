"""How the worker half brings a stored prefix into vLLM's blocks: one load strategy per server, chosen once from
its spec (worker.load_strategy), and the fetch of a computed prefix's compressed copy for the proposer.

  FullCopyLoad        the full copy streamed layer by layer into the request's blocks (store.full_copy, the same
                      loop the engine's prefix cache uses); with the proposer, the compressed copy is fetched
                      beside it where a pre-draft could pay (_post_compressed): the proposer drafts at once
  Split16Load         split_load.py: split16's halves, upper first (the proposer's copy), lower right behind
  CompressedOnlyLoad  the drafter role: the compressed copy alone, decoded into the blocks (lossy, by design)
  DraftFetch          a prefix vLLM computes instead of loading: only its compressed copy, for the proposer

Every strategy shares one LoadContext with the worker (its paged views, the store client, the link meter, the
stats, the handoff, the compressed copies' learned transfer time) and reports through it: a load that has ended
(get_finished) and the blocks of one that failed (get_block_ids_with_load_errors: vLLM recomputes them). Loads
run on the store loop; a failed one never fails the request, and a missing or broken compressed copy only costs
the drafts.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
from vllm.logger import init_logger

from ....compressors import Compressor, LayeredKV
from ....store.client import StoreClient
from ....store.config import RemoteCacheConfig
from ....store.full_copy import stream_full_copy
from ..handoff import DraftHandoff
from .load_plan import LinkMeter
from .metadata import LoadSpec
from .paged_layout import scatter_tokens
from .stats import StatsRecorder

logger = init_logger("vllm.vericache")


@dataclass
class LoadContext:
    """What the worker half's loads share with it, explicitly (the strategies hold nothing of the worker)."""

    cfg: RemoteCacheConfig
    block_size: int
    num_kv_heads: int
    head_dim: int
    client: StoreClient
    compressor: Compressor
    handoff: DraftHandoff | None  # the proposer's (None: it is not run)
    meter: LinkMeter  # what the loads move, reported to the scheduler side each step
    stats: StatsRecorder
    load_ended: Callable[[str], None]  # a load is over (loaded or failed): get_finished reports its request
    # a load failed: the blocks vLLM recomputes (get_block_ids_with_load_errors), its request and the error
    load_failed: Callable[[list[int], str, BaseException], None]
    views: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # per layer, register_kv_caches
    compressed_s_per_token: float | None = None  # a compressed copy's measured fetch time per token

    def learn_transfer(self, per_token: float) -> None:
        """A compressed copy's transfer time per token (EMA): what the next fetch decision weighs."""
        old = self.compressed_s_per_token
        self.compressed_s_per_token = per_token if old is None else 0.7 * old + 0.3 * per_token


class LoadJob:
    """One load in flight: the blocks it fills (from spec.start's block on), when its copies arrived (seconds
    after t0), the event that stops a pre-draft once every byte is in, and the proposer's posts still running."""

    def __init__(self, spec: LoadSpec, block_size: int):
        self.spec, self.t0, self.n = spec, time.perf_counter(), len(spec.prefix)
        first = spec.start // block_size
        self.blocks = spec.block_ids[first : self.n // block_size]  # what vLLM recomputes if the load fails
        self.ids, self.lo = torch.tensor(self.blocks), first * block_size
        self.loaded, self.when, self.posts = threading.Event(), {}, []

    def put(self, views, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """A layer's K/V ([H_kv, n, D], from token 0) into the blocks, from token lo on."""
        kv, vv = views[layer]
        scatter_tokens(kv, self.ids, k[:, self.lo : self.n])
        scatter_tokens(vv, self.ids, v[:, self.lo : self.n])


class LoadStrategy(Protocol):
    async def load(self, spec: LoadSpec, idle: bool) -> None:
        """Bring spec's prefix into its blocks, then ctx.load_ended (and ctx.load_failed with the blocks, if it
        failed); idle: vLLM runs no forward this step (a pre-draft could run beside the load)."""


async def fetch_compressed(ctx: LoadContext, spec: LoadSpec, when: dict, t0: float) -> LayeredKV | None:
    """The compressed copy of exactly this prefix (None: none stored), arrived."""
    got = await asyncio.wait_for(ctx.client.store.get_compressed(spec.prefix, ctx.compressor.spec), ctx.cfg.timeout_s)
    if got is None:
        ctx.stats.miss("compressed")
        return None
    comp = arrived(ctx, spec, LayeredKV.from_payload(*got), when, t0)
    ctx.stats.count("bytes_read", "compressed", n=comp.nbytes)
    return comp


def arrived(ctx: LoadContext, spec: LoadSpec, comp: LayeredKV, when: dict, t0: float) -> LayeredKV:
    """A compressed copy whose checksums passed, checked against the model too (ValueError); its arrival
    in when["compressed"], its transfer time learned for the next decision."""
    n = len(spec.prefix)
    ctx.compressor.validate(comp, n, len(ctx.views), ctx.num_kv_heads, ctx.head_dim)
    when["compressed"] = time.perf_counter() - t0
    ctx.learn_transfer(when["compressed"] / n)
    ctx.stats.count("hits", "compressed")
    return comp


class FullCopyLoad:
    """Compressed copy -> the proposer (it drafts at once), full copy -> the request's blocks, both at the same
    time; then the request is reported done (and its blocks, if the full copy failed)."""

    def __init__(self, ctx: LoadContext):
        self.ctx = ctx

    async def load(self, spec: LoadSpec, idle: bool) -> None:
        await self._run(LoadJob(spec, self.ctx.block_size), idle)

    async def _run(self, job: LoadJob, idle: bool) -> None:
        ctx, spec = self.ctx, job.spec
        drafting = asyncio.ensure_future(self._post_compressed(job) if idle else asyncio.sleep(0))
        ctx.meter.begin()
        try:
            await self._bring(job)
            ctx.stats.observe("load_seconds", time.perf_counter() - job.t0)
            logger.info(
                "hit %s: %d tokens loaded (compressed copy after %s, %sfull after %.2fs)",
                spec.req_id,
                job.n - spec.start,
                f"{job.when['compressed']:.2f}s" if "compressed" in job.when else "-",
                f"its lower halves after {job.when['lower halves']:.2f}s, " if "lower halves" in job.when else "",
                time.perf_counter() - job.t0,
            )
        except BaseException as e:  # noqa: BLE001 - vLLM recomputes the blocks
            ctx.stats.load_failed(e)
            logger.warning(
                "load of %s failed (%s: %s): vLLM recomputes its %d blocks",
                spec.req_id,
                type(e).__name__,
                e,
                len(job.ids),
            )
            ctx.load_failed(job.blocks, spec.req_id, e)
        finally:
            ctx.meter.end()
            job.loaded.set()
            ctx.load_ended(spec.req_id)
            await asyncio.gather(drafting, *job.posts, return_exceptions=True)

    async def _bring(self, job: LoadJob) -> None:
        """The request's KV into its blocks: here, the full copy streamed."""
        await self._stream(job)

    async def _stream(self, job: LoadJob, keep: dict | None = None) -> None:
        """The full copy, streamed layer by layer into the blocks (each layer also into `keep`, if given)."""
        ctx = self.ctx

        def put(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            ctx.meter.moved(k.nbytes + v.nbytes)
            ctx.stats.count("bytes_read", "full", n=k.nbytes + v.nbytes)
            job.put(ctx.views, layer, k, v)
            if keep is not None:
                keep[layer] = (k, v)

        shape = (ctx.num_kv_heads, job.n, ctx.head_dim)
        await stream_full_copy(ctx.client.store, job.spec.prefix, len(ctx.views), ctx.cfg.timeout_s, put, shape=shape)

    def _fetches_beside(self) -> bool:
        """The compressed copy is fetched beside the full copy (split16 with the proposer: never, Split16Load)."""
        return True

    async def _post_compressed(self, job: LoadJob) -> None:
        """Fetch the compressed copy and hand it to the proposer, which pre-drafts until `loaded`. A missing
        or broken copy only costs the drafts: vLLM decodes without them."""
        ctx, spec = self.ctx, job.spec
        handoff = ctx.handoff
        if (
            handoff is None
            or not handoff.pacing.wants_copies
            or not self._fetches_beside()
            or handoff.seeded(spec.prompt)
        ):
            return
        per_token = ctx.compressed_s_per_token
        expected_s = None if per_token is None else per_token * job.n
        if not ctx.handoff.pacing.worth_predraft(expected_s, spec.max_tokens):
            logger.info(
                "%s: compressed copy not fetched (~%.2fs on the link would delay the full copy by more than "
                "pre-drafts save)",
                spec.req_id,
                expected_s,
            )
            return
        try:
            comp = await fetch_compressed(ctx, spec, job.when, job.t0)
            if comp is not None:
                await asyncio.to_thread(ctx.handoff.post, spec.prefix, comp, spec.prompt, job.loaded)
        except Exception as e:  # noqa: BLE001
            ctx.stats.miss("compressed", e)
            logger.warning(
                "compressed copy of %s unusable (%s: %s): no drafts for it", spec.req_id, type(e).__name__, e
            )


class DraftFetch:
    """A prefix vLLM computes instead of loading: only its compressed copy comes, for the proposer to draft on
    once the request runs (no pre-draft: the CPU is computing). A missing or broken copy only costs the drafts."""

    def __init__(self, ctx: LoadContext):
        self.ctx = ctx

    async def fetch(self, spec: LoadSpec) -> None:
        ctx = self.ctx
        ctx.meter.begin()
        try:
            comp = await fetch_compressed(ctx, spec, {}, time.perf_counter())
            if comp is not None:
                ctx.meter.moved(comp.nbytes)
                ctx.handoff.post(spec.prefix, comp)
        except Exception as e:  # noqa: BLE001
            ctx.stats.miss("compressed", e)
            logger.warning(
                "compressed copy of %s unusable (%s: %s): no drafts for it", spec.req_id, type(e).__name__, e
            )
        finally:
            ctx.meter.end()


class CompressedOnlyLoad:
    """The drafter role (drafter.py): the compressed copy, decoded, into the request's blocks; never the full
    copy. vLLM computes the blocks instead where there is no such copy or it does not fit."""

    def __init__(self, ctx: LoadContext):
        self.ctx = ctx

    async def load(self, spec: LoadSpec, idle: bool) -> None:  # the strategy's signature; idle unused here
        ctx, job = self.ctx, LoadJob(spec, self.ctx.block_size)
        try:
            got = await asyncio.wait_for(
                ctx.client.store.get_compressed(spec.prefix, ctx.compressor.spec), ctx.cfg.timeout_s
            )
            if got is None:
                raise LookupError("the compressed copy is gone")
            fetched = time.perf_counter() - job.t0
            comp = LayeredKV.from_payload(*got)  # checksums passed; it must also fit the model
            ctx.compressor.validate(comp, job.n, len(ctx.views), ctx.num_kv_heads, ctx.head_dim)
            await asyncio.to_thread(self._put, comp, job)
            logger.info(
                "drafter: %s: compressed copy of %d tokens loaded (%d bytes in %.2fs, into blocks after %.2fs); "
                "the full copy is never read",
                spec.req_id,
                job.n - spec.start,
                comp.nbytes,
                fetched,
                time.perf_counter() - job.t0,
            )
        except BaseException as e:  # noqa: BLE001 - vLLM computes the blocks instead
            logger.warning(
                "drafter: compressed load of %s failed (%s: %s): vLLM computes its %d blocks",
                spec.req_id,
                type(e).__name__,
                e,
                len(job.ids),
            )
            ctx.load_failed(job.blocks, spec.req_id, e)
        finally:
            ctx.load_ended(spec.req_id)

    def _put(self, comp: LayeredKV, job: LoadJob) -> None:
        for layer, (kv, _) in enumerate(self.ctx.views):
            k, v = comp.layer_kv(layer, kv.dtype)  # [H_kv, n, D]: every token, dequantized
            if k.shape[1] != job.n or v.shape[1] != job.n:
                raise ValueError(f"compressed copy layer {layer} holds {k.shape[1]} of {job.n} tokens")
            job.put(self.ctx.views, layer, k, v)
