"""Batched KV caches with a length per row, so rows can accept different numbers of drafts.

RowCache is what the model attends over and the speculative loop rolls back: `lengths[b]` valid
entries per row, `attend` (write the new entries, attend over each row's), `advance`, and the
row-wise `copy_from` that hands the draft cache the exact KV of accepted tokens. KVCache (the full
KV) and every draft cache of vericache_connector.draft implement it.

KVCache layout per layer: keys/values [B, H_kv, capacity, D]. Row b holds `lengths[b]` valid entries; a
forward writes its q new entries at [lengths[b], lengths[b] + q) and attention masks everything past
them. Rolling back after a rejected draft is only setting `lengths` (the stale entries get overwritten).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


class RowCache:
    """The protocol every cache the model runs on follows (lengths [B] on the cache's device)."""

    lengths: Tensor

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes attention reads for the valid entries."""
        raise NotImplementedError

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Write the new k/v [B, H_kv, q, D] after each row's entries and attend q [B, H, q, D] over them."""
        raise NotImplementedError

    def store_entries(self, layer: int, row: int, start: int, k: Tensor, v: Tensor) -> None:
        """Write k/v [H_kv, n, D] as entries start .. start + n of `row` (lengths unchanged)."""
        raise NotImplementedError

    def advance(self, q: int) -> None:
        self.lengths += q

    def copy_from(self, other: "KVCache", src_start: Tensor, dst_start: Tensor, count: Tensor) -> None:
        """Row-wise copy of `count[b]` entries of `other` from src_start[b] to our dst_start[b]."""
        for b, n in enumerate(count.tolist()):
            if n == 0:
                continue
            s, d = int(src_start[b]), int(dst_start[b])
            for layer in range(len(other.keys)):
                self.store_entries(
                    layer, b, d, other.keys[layer][b, :, s : s + n], other.values[layer][b, :, s : s + n]
                )


class KVCache(RowCache):
    def __init__(
        self,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        shape = (batch, num_kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.capacity = capacity

    @property
    def nbytes(self) -> int:
        """Bytes of the valid entries (what attention reads)."""
        per_token = sum(k[0, :, 0].nbytes + v[0, :, 0].nbytes for k, v in zip(self.keys, self.values))
        return int(self.lengths.sum()) * per_token

    def load_row(self, row: int, keys: list[Tensor], values: list[Tensor]) -> None:
        """Set row `row` to the given per-layer [H_kv, T, D] keys/values."""
        t = keys[0].shape[1]
        if t > self.capacity:
            raise ValueError(f"{t} tokens do not fit a cache of capacity {self.capacity}")
        for layer, (k, v) in enumerate(zip(keys, values)):
            self.store_entries(layer, row, 0, k, v)
        self.lengths[row] = t

    def store_entries(self, layer: int, row: int, start: int, k: Tensor, v: Tensor) -> None:
        n = k.shape[1]
        if start + n > self.capacity:
            raise ValueError(f"KV cache overflow: {start} + {n} > capacity {self.capacity}")
        self.keys[layer][row, :, start : start + n] = k
        self.values[layer][row, :, start : start + n] = v

    def write(self, layer: int, k: Tensor, v: Tensor) -> None:
        """Write new k/v [B, H_kv, q, D] at each row's current end (lengths are advanced by `advance`)."""
        q = k.shape[2]
        if int(self.lengths.max()) + q > self.capacity:
            raise ValueError(f"KV cache overflow: {int(self.lengths.max())} + {q} > capacity {self.capacity}")
        if q > 1 and self.batch == 1:
            start = int(self.lengths[0])
            self.keys[layer][0, :, start : start + q] = k[0]
            self.values[layer][0, :, start : start + q] = v[0]
            return
        rows = torch.arange(self.batch, device=k.device)[:, None]  # [B, 1]
        cols = self.lengths[:, None] + torch.arange(q, device=k.device)[None]  # [B, q]
        self.keys[layer][rows, :, cols] = k.transpose(1, 2)  # [B, q, H, D]
        self.values[layer][rows, :, cols] = v.transpose(1, 2)

    def view(self, layer: int, q: int) -> tuple[Tensor, Tensor]:
        """Keys/values up to the longest row's end after writing q entries."""
        end = int(self.lengths.max()) + q
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def mask(self, q: int) -> Tensor:
        """Boolean attention mask [B, 1, q, end]: entry j is visible to new query i of row b
        iff j < lengths[b] + i + 1 (old entries plus the new ones up to and including i)."""
        end = int(self.lengths.max()) + q
        j = torch.arange(end, device=self.lengths.device)
        limit = self.lengths[:, None] + torch.arange(1, q + 1, device=self.lengths.device)[None]  # [B, q]
        return (j[None, None, :] < limit[:, :, None])[:, None]

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Write the new k/v [B, H_kv, q, D] and attend the queries q [B, H, q, D] over each row's
        entries (causal among the new ones; a first batch-1 write is a causal prefill)."""
        lq = q.shape[2]
        prefill = self.batch == 1 and int(self.lengths[0]) == 0
        mask = None if prefill else self.mask(lq)
        self.write(layer, k, v)
        k_all, v_all = self.view(layer, lq)
        return F.scaled_dot_product_attention(
            q, k_all, v_all, attn_mask=mask, is_causal=prefill, enable_gqa=q.shape[1] != k.shape[1]
        )
