"""The serving engine's model runner: a prefill of one prompt, or one mixed step over many sequences.

A step runs ONE forward over every scheduled token, packed back to back ([1, N], each token at its true
position): the drafting rows' single tokens attend over the compressed KV in the draft pool, the
verifying rows' [pending, d_1..d_k] over their full KV in the full pool (reloaded prompt in staging
blocks + resident tail and emitted tokens), full-KV / lossy rows over their own pool. The linear layers,
which read every weight once per forward, are shared by all of them; only attention is per pool:
StepCache writes each segment's new entries into its pool and calls the paged attention kernel once per
pool and layer (rows whose quantized prompt sits in the packed pool: packed_paged_attention over the packed
prompt and their draft-pool entries in one pass). A verifying row's layer l waits for that layer of its reload (Reload.wait_layer): the
verify forward starts while later layers are still on the link.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import vericache_kernels.paged as PA
import vericache_kernels.paged_packed as PP

from ..model.kv_cache import RowCache
from .block_manager import KVPool, PackedPool
from .host_tier import HostEntry, Reload
from .sequence import Sequence

Tensor = torch.Tensor


@dataclass
class Segment:
    """One sequence's tokens in a step: they attend over `view` (block ids of the pool) whose first
    `start` entries are already there; their own entries are written at start .. start + len(tokens)."""

    seq: Sequence
    pool: str
    tokens: list[int]
    positions: list[int]
    view: list[int]
    start: int
    kind: str  # draft | verify | decode
    reload: Reload | None = None
    packed: list[int] | None = None  # blocks of the packed pool holding the row's quantized prompt
    packed_len: int = 0  # its entries (all visible, before the view's)


@dataclass
class Batch:
    """What one step runs (Scheduler.schedule): one prompt's prefill, or the rows of one packed forward."""

    prefill: Sequence | None = None
    segments: list[Segment] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return self.prefill is None and not self.segments


@dataclass
class Prefilled:
    """A prefill's result (ServingEngine's run phase): the first token and where the prompt's KV went."""

    first: int
    draft_len: int = 0  # entries of the compressed prompt in the draft pool
    host: HostEntry | None = None  # VeriCache: the prompt's whole blocks in the host tier
    packed_len: int = 0  # entries of the compressed prompt in the packed pool


@dataclass
class Sampled:
    """One row's result of a packed step: a decoded / drafted token (q: its law, temperature > 0), or a
    verification's accepted drafts and the token after them."""

    token: int
    q: torch.Tensor | None = None
    accepted: int = 0


@dataclass
class _PoolBatch:
    pool: KVPool
    lo: int  # this pool's tokens are [lo, hi) of the packed step
    hi: int
    slots: Tensor
    query_start_loc: Tensor
    seq_lens: Tensor
    block_table: Tensor
    reloads: list[Reload] = field(default_factory=list)
    plan: Tensor | None = None
    packed: PackedPool | None = None  # the rows' prompts are packed there (packed_paged_attention)
    prefix_lens: Tensor | None = None
    prefix_table: Tensor | None = None


class StepCache(RowCache):
    """The cache of one packed step (batch 1 of N tokens): routes each segment to its pool."""

    def __init__(self, pools: dict[str, KVPool], segments: list[Segment], backend: str = "auto"):
        self.lengths = torch.zeros(1, dtype=torch.long)
        self.backend, self.batches, self.wait_s = backend, [], 0.0
        lo = 0
        for name in sorted({s.pool for s in segments}):
            segs = [s for s in segments if s.pool == name]
            pool = pools[name]
            dev = pool.caches[0][0].device
            n = [len(s.tokens) for s in segs]
            slots = torch.cat([pool.slots(s.view, s.start, len(s.tokens)) for s in segs])
            qsl = torch.tensor([0] + n, dtype=torch.int32, device=dev).cumsum(0, dtype=torch.int32)
            lens = torch.tensor([s.start + len(s.tokens) for s in segs], dtype=torch.int32, device=dev)
            width = max(len(s.view) for s in segs)
            table = torch.tensor([s.view + [0] * (width - len(s.view)) for s in segs], dtype=torch.int32, device=dev)
            batch = _PoolBatch(
                pool, lo, lo + sum(n), slots, qsl, lens, table, [s.reload for s in segs if s.reload is not None]
            )
            if any(s.packed is not None for s in segs):
                pw = max(1, max(len(s.packed or []) for s in segs))
                batch.packed = pools["packed"]
                batch.prefix_lens = torch.tensor([s.packed_len for s in segs], dtype=torch.int32, device=dev)
                batch.prefix_table = torch.tensor(
                    [(s.packed or []) + [0] * (pw - len(s.packed or [])) for s in segs], dtype=torch.int32, device=dev
                )
            self.batches.append(batch)
            lo += sum(n)
        self.order = [s for name in sorted({s.pool for s in segments}) for s in segments if s.pool == name]

    @property
    def nbytes(self) -> int:
        return 0

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        qf, kf, vf = q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)  # [N, H, D]
        out = torch.empty_like(qf)
        for b in self.batches:
            for r in b.reloads:
                self.wait_s += r.wait_layer(layer)
            b.pool.write(layer, b.slots, kf[b.lo : b.hi], vf[b.lo : b.hi])
            out[b.lo : b.hi] = self._attend_pool(b, layer, qf[b.lo : b.hi]).to(q.dtype)
            for r in b.reloads:
                r.consume(layer)
        return out.transpose(0, 1)[None]

    def _attend_pool(self, b: _PoolBatch, layer: int, q: Tensor) -> Tensor:
        kc, vc = b.pool.caches[layer]
        if b.packed is not None:  # the packed prompt + this pool's entries in one pass (codes never decoded)
            return PP.packed_paged_attention(
                q,
                b.query_start_loc,
                b.packed.fmt,
                b.packed.caches[layer],
                b.prefix_lens,
                b.prefix_table,
                kc,
                vc,
                b.seq_lens,
                b.block_table,
                backend=self.backend,
            )
        qb = q.to(b.pool.dtype)
        if b.plan is None and PA.uses_vllm_kernel(self.backend, b.pool.kv_dtype, qb, kc):
            b.plan = PA.paged_attention_plan(qb, kc.shape[1], b.query_start_loc, b.seq_lens, b.pool.kv_dtype)
        return PA.paged_attention(
            qb, kc, vc, b.query_start_loc, b.seq_lens, b.block_table, b.pool.kv_dtype, plan=b.plan, backend=self.backend
        )

    def advance(self, q: int) -> None:
        return  # the scheduler keeps each sequence's lengths


class PrefillCache(RowCache):
    """One prompt's forward: causal attention over its own entries. Each layer's K/V [H_kv, T, D] (and its
    last `obs_window` queries) go to on_layer as soon as the layer is done, so the caller can move them to
    the host tier / the compressor / its blocks and no more than one layer's KV lives at a time."""

    def __init__(self, on_layer, obs_window: int = 0):
        self.lengths = torch.zeros(1, dtype=torch.long)
        self.on_layer, self.obs_window = on_layer, obs_window

    @property
    def nbytes(self) -> int:
        return 0

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        obs = q[0, :, -self.obs_window :] if self.obs_window else None
        self.on_layer(layer, k[0], v[0], obs)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])

    def advance(self, q: int) -> None:
        self.lengths += q


class ModelRunner:
    def __init__(self, model, pools: dict[str, KVPool], backend: str = "auto"):
        self.model, self.pools, self.backend = model, pools, backend

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], obs_window: int, on_layer, store: dict | None = None) -> Tensor:
        """Run the prompt; on_layer(layer, k, v, obs) per layer. -> last-position logits [V].
        store: a dict memoizing prefills by prompt (a benchmark runs one trace under several policies; the
        layers are then replayed from it, at the cost of copying them)."""
        key = (tuple(prompt_ids), obs_window)
        if store is not None and key in store:
            logits, layers = store[key]
            for layer, (k, v, obs) in enumerate(layers):
                on_layer(layer, k, v, obs)
            return logits
        kept = []

        def keep(layer, k, v, obs):
            if store is not None:
                kept.append((k, v, obs))
            on_layer(layer, k, v, obs)

        dev, t = self.model.device, len(prompt_ids)
        cache = PrefillCache(keep, min(obs_window, t))
        logits, _ = self.model(
            torch.tensor([prompt_ids], device=dev), torch.arange(t, device=dev)[None], cache, last_only=True
        )
        if store is not None:
            store[key] = (logits[0, -1], kept)
        return logits[0, -1]

    @torch.inference_mode()
    def step(self, segments: list[Segment]) -> tuple[dict[int, Tensor], float, float]:
        """One packed forward. -> ({id(seq): logits [len(tokens), V]}, seconds, seconds waiting on the link)."""
        t0 = time.perf_counter()
        cache = StepCache(self.pools, segments, self.backend)
        dev = self.model.device
        ids = torch.tensor([[t for s in cache.order for t in s.tokens]], device=dev)
        pos = torch.tensor([[p for s in cache.order for p in s.positions]], device=dev)
        logits, _ = self.model(ids, pos, cache)
        out, at = {}, 0
        for s in cache.order:
            out[id(s.seq)] = logits[0, at : at + len(s.tokens)]
            at += len(s.tokens)
        return out, time.perf_counter() - t0, cache.wait_s
