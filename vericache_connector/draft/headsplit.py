"""Per-head budgets in the draft caches: every (row, KV head) becomes a row of its own.

A compressed copy with per-head budgets (compressors/heads.py: AdaKV, KVzip, PyramidKV through
kvpress) keeps n[l, b, h] positions in KV head h of layer l for row b. The draft layouts keep one length
per row, shared by its heads and layers, and padding a head up to a common length is not exact: a
duplicated entry counts twice in the softmax, a zero key still gets weight exp(0 - max). So
HeadSplitCache runs the configured layout over B * H_kv rows of ONE KV head each: row (b, h) holds
exactly head h's n[l, b, h] entries and then row b's emitted tokens. Each head's softmax is over its own
entries (exact, no padding anywhere) and every layer is still one call of the layout's kernel.

Lengths: the speculative loop reads and sets `lengths[b] = P_b + e_b` (P_b = max of n[:, b, :], a logical
prefix length; e_b = entries written after the prefix). Inner row (b, h) of layer l has
n[l, b, h] + e_b = lengths[b] - off[l, b, h] entries (off = P_b - n); they are derived before every call.
GQA: query heads [h G, (h + 1) G) read KV head h, so q [B, H_q, Lq, D] is viewed as [B H_kv, G, Lq, D].
The "packed" layout (bit-packed codes) has nothing to unpack here and keeps its prefix length per row,
not per layer; per-head copies use "dense" in its place.
"""

from __future__ import annotations

import dataclasses

import torch

from ..compressors import CompressedKV
from ..compressors.heads import head_kv
from ..model.kv_cache import KVCache, RowCache
from .config import DraftConfig

Tensor = torch.Tensor


class _HeadView(CompressedKV):
    """One KV head of one compressed copy as a one-head copy (what the inner layouts decode)."""

    spec = "head-view"

    def __init__(self, layers: list[tuple[Tensor, Tensor]]):
        self.layers = layers  # per layer (k, v) [1, n_l, D]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_kv(self, layer: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        k, v = self.layers[layer]
        return k.to(dtype), v.to(dtype)

    def to_payload(self):
        raise NotImplementedError("a head view is not stored")

    @classmethod
    def from_payload(cls, meta, layers):
        raise NotImplementedError("a head view is not stored")


class _OneHeadModel:
    """What the layouts read of a model (cfg, device, dtype, new_cache), with one KV head and the G
    query heads of its group."""

    def __init__(self, model):
        c = model.cfg
        self.cfg = dataclasses.replace(c, num_kv_heads=1, num_heads=c.num_heads // c.num_kv_heads)
        self.device, self.dtype = model.device, model.dtype

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        c = self.cfg
        return KVCache(c.num_layers, batch, 1, c.head_dim, capacity, self.dtype, self.device)


class HeadSplitCache(RowCache):
    """A draft cache for rows with per-head budgets: the configured layout over B * H_kv one-head rows."""

    def __init__(self, model, compressed: list[CompressedKV], extra: int, cfg: DraftConfig):
        from . import make_draft_cache

        mc, heads = model.cfg, model.cfg.num_kv_heads
        decoded: dict[int, list] = {}  # per object, per layer (k, v, lengths[H])
        for row, c in enumerate(compressed):
            if c.num_layers != mc.num_layers:
                raise ValueError(f"compressed cache {row} has {c.num_layers} layers, the model {mc.num_layers}")
            if id(c) not in decoded:
                decoded[id(c)] = [head_kv(c, layer, torch.float32) for layer in range(mc.num_layers)]
        n = torch.stack(
            [torch.stack([decoded[id(c)][layer][2] for c in compressed]) for layer in range(mc.num_layers)]
        ).to(model.device)  # [L, B, H]
        if n.shape[-1] != heads:
            raise ValueError(f"compressed caches have {n.shape[-1]} KV heads, the model {heads}")
        prefix = n.amax(dim=(0, 2))  # [B]
        self.offsets = prefix[None, :, None] - n  # [L, B, H]
        views: dict[tuple[int, int], _HeadView] = {}
        rows = []
        for c in compressed:
            for h in range(heads):
                if (id(c), h) not in views:
                    layers = decoded[id(c)]
                    views[id(c), h] = _HeadView(
                        [(k[h : h + 1, : int(m[h])], v[h : h + 1, : int(m[h])]) for k, v, m in layers]
                    )
                rows.append(views[id(c), h])
        layout = cfg.resolve_layout(model.device)
        inner_cfg = dataclasses.replace(cfg, layout="dense" if layout == "packed" else layout)
        # the layouts size their rows from layer 0's prefix length; later layers may keep more
        room = int((n.amax(0) - n[0]).max())
        self.inner = make_draft_cache(_OneHeadModel(model), rows, extra + room, inner_cfg)
        self.heads = heads
        self.lengths = prefix.clone()

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes

    def _sync(self, layer: int) -> None:
        self.inner.lengths = (self.lengths[:, None] - self.offsets[layer]).reshape(-1)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Write k/v [B, H_kv, Lq, D] and attend q [B, H_q, Lq, D], each head over its own entries."""
        b, hq, lq, d = q.shape
        h = self.heads
        self._sync(layer)
        out = self.inner.attend(
            layer, q.reshape(b * h, hq // h, lq, d), k.reshape(b * h, 1, lq, d), v.reshape(b * h, 1, lq, d)
        )
        return out.reshape(b, hq, lq, d)

    def store_entries(self, layer: int, row: int, start: int, k: Tensor, v: Tensor) -> None:
        """start counts like lengths (P_b + e); head h's entry goes to its own row at start - off."""
        for h in range(self.heads):
            s = start - int(self.offsets[layer, row, h])
            self.inner.store_entries(layer, row * self.heads + h, s, k[h : h + 1], v[h : h + 1])
