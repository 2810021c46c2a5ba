"""A compressed VIEW of a request's own KV in vLLM's paged blocks: which blocks a draft step attends to.

Self-drafting (vLLM RFC #47351, MagicDec): the served model drafts on a token-dropped view of each request's
KV and vLLM verifies the drafts on the whole KV. Where reading the KV dominates a decode step (long contexts x
many requests) the draft step reads a fraction of the bytes. The view is a list of the request's own blocks,
handed to vLLM's attention kernel as a compacted block table whose sequence length is the view's: no K/V is
copied. Keys in vLLM's cache are rotated at their true positions, so attention over a subset of blocks is
attention over a subset of tokens; the draft's new tokens are rotated at their true positions too.

A view holds, per layer:
  SINK      the first `sink` blocks (the attention sinks of StreamingLLM);
  SELECTED  the `selected` other full blocks most likely to matter to this step's query: Quest's bound, per
            block and KV head the per-channel min and max of its keys bound q.k from above (sum over d of
            max(q_d min_d, q_d max_d)); a block scores the largest bound of its heads' query groups;
  RECENT    the last `recent` full blocks;
  TAIL      the block the next token is written to (holding the tokens after the last full block).
A request with no more blocks than a view holds is attended whole. The bounds of a full block never change
(vLLM writes a block's tokens once), so they are computed once per request and block (KeyBounds).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

import torch

Tensor = torch.Tensor
VIEW_ENV = "VERICACHE_DRAFT_VIEW"


@dataclass(frozen=True)
class ViewPolicy:
    sink: int = 1
    selected: int = 4
    recent: int = 1
    # a row drafts on its view only where the view holds at most this share of the row's blocks. A draft step
    # always pays the model's linear layers and saves only the attention the view leaves out: measured on the
    # CPU (benchmarks/view_step_time.py), a view of half the KV (1,792 tokens) cost 0.87-1.01x vLLM's step and
    # one of 14% (6,400 tokens) 0.44-0.67x, where drafting breaks even near 0.41x
    max_share: float = 0.25

    def __post_init__(self):
        for name in ("sink", "selected", "recent"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"view {name} must be a non-negative integer, got {getattr(self, name)!r}")
        if not 0 < self.max_share <= 1:
            raise ValueError(f"view max_share must be in (0, 1], got {self.max_share!r}")

    @property
    def full_blocks(self) -> int:
        """Full blocks a view holds (the tail block comes on top)."""
        return self.sink + self.selected + self.recent

    def small_enough(self, length: int, block_size: int) -> bool:
        """A row of `length` tokens is long enough for its view (full blocks + the tail) to be at most max_share
        of its blocks."""
        return self.full_blocks + 1 <= self.max_share * (length // block_size + 1)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ViewPolicy | None:
        """VERICACHE_DRAFT_VIEW: "off" (no self-drafting), unset (the defaults) or "sink=1,selected=4,recent=1,
        max_share=0.25" (any of them). ValueError naming a bad entry."""
        text = (os.environ if env is None else env).get(VIEW_ENV, "").strip()
        if text.lower() == "off":
            return None
        fields: dict[str, int | float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, _, value = (x.strip() for x in part.partition("="))
            if name == "max_share" and value.replace(".", "", 1).isdigit():
                fields[name] = float(value)
            elif name in ("sink", "selected", "recent") and value.isdigit():
                fields[name] = int(value)
            else:
                raise ValueError(
                    f"{VIEW_ENV} entries are sink=N, selected=N, recent=N or max_share=F (or 'off'), got {part!r}"
                )
        return cls(**fields)


def key_bounds(keys: Tensor) -> Tensor:
    """keys [blocks, H_kv, block_size, D] (a view of vLLM's cache) -> [blocks, H_kv, 2, D]: per channel min, max."""
    return torch.stack((keys.amin(dim=2), keys.amax(dim=2)), dim=2)


def block_scores(q: Tensor, bounds: Tensor) -> Tensor:
    """Quest's upper bound of q.k per block. q [R, Hq, D] (one query per row), bounds [R, B, H_kv, 2, D] ->
    [R, B]: per block the largest bound over the query heads (grouped onto their KV heads). The bound
    sum_d max(q_d min_d, q_d max_d) is q+ . max + q- . min (q+ / q-: q's positive / negative parts): two
    batched matmuls, no [R, B, H, D] product in memory."""
    r, hq, d = q.shape
    hk = bounds.shape[2]
    qg = q.view(r, hk, hq // hk, d)
    lo, hi = bounds[:, :, :, 0], bounds[:, :, :, 1]  # [R, B, H_kv, D]
    s = torch.einsum("rhgd,rbhd->rbhg", qg.clamp(min=0), hi) + torch.einsum("rhgd,rbhd->rbhg", qg.clamp(max=0), lo)
    return s.amax(dim=-1).amax(dim=-1)


def view_tables(
    blocks: Tensor, lengths: Tensor, policy: ViewPolicy, block_size: int, scores: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Each row's view for a query written at position lengths[r]: blocks int32 [R, B] (vLLM's block table rows:
    row r's first full_r = lengths[r] // block_size blocks are full, block full_r is its tail), scores [R, B]
    ranking the full blocks for SELECTED (None: the most recent middle blocks are taken). -> (block_table int32
    [R, W], seq_lens int32 [R]): the kept full blocks in order, then the tail block; seq_len counts the kept
    blocks' tokens and the tail's up to and including position lengths[r]. All rows at once (no Python per row:
    this runs for every layer of every draft step)."""
    r, b = blocks.shape
    full = (lengths // block_size).long()  # [R]
    col = torch.arange(b)[None]  # [1, B]
    middle = (col >= policy.sink) & (col < (full - policy.recent)[:, None])
    whole = full <= policy.full_blocks  # such a row keeps every full block
    if scores is None:
        scores = col.float().expand(r, b)
    ranked = scores.float().masked_fill(~middle, float("-inf"))
    picks = ranked.topk(min(policy.selected, b), dim=1).indices if policy.selected else col[:, :0].expand(r, 0)
    chosen = torch.zeros(r, b, dtype=torch.bool)
    chosen.scatter_(1, picks, True)
    keep = (chosen & middle) | (col < policy.sink) | (col >= (full - policy.recent)[:, None])
    keep = (keep | whole[:, None]) & (col < full[:, None])
    kept = keep.sum(dim=1)  # full blocks in each view
    order = torch.where(keep, col, b).sort(dim=1).values  # kept columns first, in block order
    width = int(kept.max()) + 1
    table = blocks.gather(1, order[:, :width].clamp(max=b - 1)).to(torch.int32)
    table.scatter_(1, kept[:, None], blocks.gather(1, full[:, None].clamp(max=b - 1)).to(torch.int32))
    seq_lens = kept * block_size + lengths - full * block_size + 1
    return table, seq_lens.to(torch.int32)
