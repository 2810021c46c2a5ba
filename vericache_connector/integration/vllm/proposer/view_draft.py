"""Self-drafting: greedy drafts of every drafting request at once, on a compressed view of its own KV.

    for each draft step (rows still drafting):
        x = embed(each row's last token)                    # at its true position p = the row's length - 1
        for each layer:
            q, k, v = qkv_rope(norm_in(x))                  # the served model's modules (no weight copy)
            write k, v at each row's slot of position p     # vLLM's own blocks: see below
            view = sink + best-bounded + recent + tail blocks (view.py, scored with this q)
            o = vLLM's paged attention over the view        # a compacted block table: no K/V copied
            x = x + o_proj(o);  x = x + mlp(norm_post(x))
        draft = argmax(head(norm(x)))

Where the draft writes. After a step, vLLM has computed the KV of every position before the row's last token;
the slots from that token's position on are allocated to the request but not computed. vLLM's next (verify)
forward writes the KV of the last token and of every draft it verifies at exactly those slots, so a draft's own
K/V written there is overwritten before anything reads it, and a slot past what vLLM verifies lies past the
request's length (no attention reads it; a block is shared through the prefix cache only once full of computed
tokens). A row drafts only into slots its blocks already hold (vLLM reserves no lookahead for a custom
proposer): at most up to the end of its last block. Nothing before the row's length is ever written.
"""

from __future__ import annotations

import time

import torch

import vericache_kernels.paged as PA

from .runner_state import RunnerState
from .view import ViewPolicy, block_scores, key_bounds, view_tables

Tensor = torch.Tensor


class ViewDrafter:
    def __init__(self, layers, state: RunnerState, policy: ViewPolicy):
        self.lay, self.state, self.policy = layers, state, policy
        self.bounds = KeyBounds(layers.num_kv_heads, layers.head_dim)
        self.step_s: float | None = None  # the last draft's seconds per draft step (its preparation left out)

    def small_enough(self, length: int) -> bool:
        """A row of `length` tokens drafts on its view: the view is at most the policy's max_share of its blocks."""
        return self.policy.small_enough(length, self.state.block_size)

    def room(self, index: int, length: int) -> int:
        """Drafts the row at batch index `index` with `length` tokens can make in its allocated slots."""
        return self.state.num_blocks([index])[0] * self.state.block_size - length + 1

    @torch.inference_mode()
    def draft(self, rows: list[tuple[int, list[int], int]]) -> list[list[int]]:
        """rows: (batch index, token row, drafts wanted) -> each row's greedy drafts (fewer where its
        allocated slots end first)."""
        lay, bs, caches = self.lay, self.state.block_size, self.state.layers()
        index = [i for i, _, _ in rows]
        want = torch.tensor([min(x, self.room(i, len(row))) for i, row, x in rows])
        blocks = self.state.blocks(index)
        pos = torch.tensor([len(row) - 1 for _, row, _ in rows])
        ids = torch.tensor([row[-1] for _, row, _ in rows])
        bounds = self._row_bounds(index, pos, blocks, caches) if self.policy.selected else None
        out: list[list[int]] = [[] for _ in rows]
        t0, steps = time.perf_counter(), int(want.max()) if len(rows) else 0
        scores: list[Tensor | None] = [None] * len(caches)  # per layer: the view's block scores
        alive = torch.arange(len(rows))  # which of `rows` each batch row of this step is
        hq, hk, d = lay.num_heads, lay.num_kv_heads, lay.head_dim
        tables: list[Tensor] = []  # per layer: the rows' views, kept while no row's tail block fills up
        for step in range(steps):
            live = want > step
            refresh = step == 0 or not bool(live.all()) or bool((pos % bs == 0).any())
            if not bool(live.all()):  # rows that have their drafts leave the batch
                blocks, pos, ids, want, alive = blocks[live], pos[live], ids[live], want[live], alive[live]
                scores = [None if s is None else s[live] for s in scores]
            n = len(alive)
            slots = blocks.gather(1, (pos // bs)[:, None]).flatten().long() * bs + pos % bs
            qsl = torch.arange(n + 1, dtype=torch.int32)
            x, plan = lay.embed(ids), None
            for i, layer_kv in enumerate(caches):
                q, k, v = lay.qkv(i, x, pos)
                key_cache, value_cache = kernel_views(layer_kv, hk, d)
                PA.paged_write(key_cache, value_cache, k.view(n, hk, d), v.view(n, hk, d), slots, "float32")
                if bounds is not None and step == 0:  # blocks chosen with the first query, for all of this draft
                    scores[i] = block_scores(q.view(n, hq, d), bounds[i])
                if refresh:
                    table, seq_lens = view_tables(blocks, pos, self.policy, bs, scores[i])
                    tables = tables[:i] + [table]
                if plan is None:  # the same view lengths in every layer: one plan per step
                    plan = PA.paged_attention_plan(q.view(n, hq, d), hk, qsl, seq_lens, "float32")
                o = PA.paged_attention(
                    q.view(n, hq, d), key_cache, value_cache, qsl, seq_lens, tables[i], "float32", plan=plan
                )
                x = lay.after_attention(i, x, o.view(n, hq * d))
            ids = lay.logits(x).argmax(dim=-1)
            for r, token in zip(alive.tolist(), ids.tolist()):
                out[r].append(token)
            pos = pos + 1
            seq_lens = seq_lens + 1  # each view holds the token just drafted (a full tail block: refreshed)
        self.step_s = (time.perf_counter() - t0) / steps if steps else None
        return out

    def _row_bounds(self, index: list[int], pos: Tensor, blocks: Tensor, caches: list[Tensor]) -> list[Tensor]:
        """Per layer [R, B, H_kv, 2, D]: each row's blocks' key bounds (view_tables masks those past its full
        blocks)."""
        full = int(pos.max()) // self.state.block_size
        self.bounds.update(caches, torch.unique(blocks[:, :full].flatten()))
        return list(self.bounds.table[:, blocks.long()])


class KeyBounds:
    """Key bounds (view.key_bounds) of vLLM's blocks, by block id, in one table [layers, blocks, H_kv, 2, D] (for
    SmolLM2-135M's 1,000 blocks of a 6 GiB KV cache: 46 MB). A full block's keys never change while it holds the
    same tokens, so its bounds are computed once; a block vLLM freed and gave to other tokens is told by its
    fingerprint (the first key of its first head in layer 0) and computed again. Requests sharing a document
    through vLLM's prefix cache share its blocks, and their bounds. A stale bound could only make a draft worse,
    never an output: vLLM verifies every draft on the whole KV."""

    def __init__(self, num_kv_heads: int, head_dim: int):
        self.hk, self.d = num_kv_heads, head_dim
        self.table: Tensor | None = None
        self.prints: Tensor | None = None  # [blocks, D]: each block's fingerprint when its bounds were taken
        self.known: Tensor | None = None  # [blocks] bool

    def update(self, caches: list[Tensor], ids: Tensor) -> None:
        """Bounds for the blocks `ids` (full blocks of running requests) where missing or stale."""
        if self.table is None:
            n = caches[0].shape[0]
            self.table = torch.zeros(len(caches), n, self.hk, 2, self.d)
            self.prints, self.known = torch.zeros(n, self.d), torch.zeros(n, dtype=torch.bool)
        ids = ids.long()
        prints = self._keys(caches[0])[ids, 0, 0]  # [n, D]
        stale = ids[~(self.known[ids] & (self.prints[ids] == prints).all(dim=1))]
        if len(stale):
            for layer, kv in enumerate(caches):
                self.table[layer, stale] = key_bounds(self._keys(kv)[stale])
            self.prints[stale] = self._keys(caches[0])[stale, 0, 0]
            self.known[stale] = True

    def _keys(self, layer: Tensor) -> Tensor:
        """The layer's keys as [blocks, H_kv, block_size, D] (a view: kernel_views' keys, transposed back)."""
        return kernel_views(layer, self.hk, self.d)[0].transpose(2, 3)


def kernel_views(layer: Tensor, num_kv_heads: int, head_dim: int) -> tuple[Tensor, Tensor]:
    """vLLM's CPU layer buffer [blocks, H_kv, bs, 2 D] as kernels.paged's (key_cache [blocks, H, D, bs], value_cache
    [blocks, H, bs, D]): per block and head vLLM's CPU attention ("vec" ISA) keeps the keys transposed, then the
    values (connector/paged_layout.py reads the same layout; the proposer reaches vLLM's KV only through here)."""
    n, bs = layer.shape[0], layer.shape[2]
    return layer.view(n, num_kv_heads, 2, head_dim, bs)[:, :, 0], layer.view(n, num_kv_heads, 2, bs, head_dim)[:, :, 1]
