"""Draft layouts "materialized" and "dense": the compressed prefix decoded (dequantized, or the kept
positions) into a plain KV cache.

  materialized  a KVCache in the model's dtype; attention is the model's SDPA.
  dense         DenseDraftCache: the same in a compact dtype (float16 on the CPU by default, bfloat16
                when a prefix value exceeds the float16 range), attended by
                vericache_kernels.cache_attention (the fused CPU flash kernel with the GQA rows stacked,
                so each KV head is read once).
"""

from __future__ import annotations

import torch

import vericache_kernels as K

from ..compressors import CompressedKV
from ..model.kv_cache import KVCache
from .config import DTYPES, DraftConfig

Tensor = torch.Tensor
FP16_MAX = 65504.0


def decode_rows(model, compressed: list[CompressedKV], dtype: torch.dtype) -> list[list[tuple[Tensor, Tensor]]]:
    """Per row, per layer (keys, values) [H_kv, L, D] in dtype; rows sharing an object share tensors."""
    done: dict[int, list] = {}
    for row, c in enumerate(compressed):
        check_layers(model, c, row)
        if id(c) not in done:
            done[id(c)] = [c.layer_kv(layer, dtype) for layer in range(c.num_layers)]
    return [done[id(c)] for c in compressed]


def check_layers(model, c: CompressedKV, row: int) -> None:
    if c.num_layers != model.cfg.num_layers:
        raise ValueError(f"compressed cache {row} has {c.num_layers} layers, the model {model.cfg.num_layers}")


def load_rows(cache: KVCache, rows) -> KVCache:
    for row, layers in enumerate(rows):
        cache.load_row(row, [k for k, _ in layers], [v for _, v in layers])
    return cache


def compact_dtype(rows) -> torch.dtype:
    """float16 (11 significant bits) unless a prefix value exceeds its range, then bfloat16."""
    peak = max(float(x.abs().amax()) for layers in rows for kv in layers for x in kv if x.numel())
    return torch.float16 if peak <= FP16_MAX else torch.bfloat16


def materialize(model, compressed: list[CompressedKV], extra: int) -> KVCache:
    """Layout "materialized": each row's prefix decoded into a KVCache in the model's dtype."""
    rows = decode_rows(model, compressed, model.dtype)
    return load_rows(model.new_cache(len(rows), max(r[0][0].shape[1] for r in rows) + extra), rows)


class DenseDraftCache(KVCache):
    """Layout "dense": a KVCache in a compact dtype whose attend runs vericache_kernels.cache_attention."""

    def __init__(self, model, compressed: list[CompressedKV], extra: int, cfg: DraftConfig):
        rows = decode_rows(model, compressed, torch.float32)
        dtype = DTYPES[cfg.dtype]
        if dtype is None and model.device.type == "cpu":
            dtype = compact_dtype(rows)
        c = model.cfg
        super().__init__(
            c.num_layers,
            len(rows),
            c.num_kv_heads,
            c.head_dim,
            max(r[0][0].shape[1] for r in rows) + extra,
            dtype or model.dtype,
            model.device,
        )
        load_rows(self, rows)
        self.backend = cfg.backend

    @property
    def dtype(self) -> torch.dtype:
        return self.keys[0].dtype

    def write(self, layer: int, k: Tensor, v: Tensor) -> None:
        super().write(layer, k.to(self.dtype), v.to(self.dtype))

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        lq = q.shape[2]
        self.write(layer, k, v)
        k_all, v_all = self.view(layer, lq)
        return K.cache_attention(q, k_all, v_all, self.lengths + lq, backend=self.backend)
