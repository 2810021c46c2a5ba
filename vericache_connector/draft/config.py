"""DraftConfig: how a draft cache holds and attends the compressed prefix, and which weights draft.

Layouts (see the package docstring): auto | packed | paged | dense | materialized. The choice only
changes how fast drafts come and, by rounding, how many are accepted; VeriCache's output never depends
on it, since the verify pass runs the model's own weights on the full KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vericache_kernels._dispatch import BACKENDS, use_triton
from vericache_kernels.paged import vllm_cpu_attention_available

from .weights import WEIGHTS

LAYOUTS = ("auto", "packed", "paged", "dense", "materialized")
DTYPES = {"auto": None, "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
PAGED_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16", "float32")


@dataclass
class DraftConfig:
    layout: str = "auto"  # auto | packed | paged | dense | materialized (see the module docstring)
    dtype: str = "auto"  # dense storage; auto: float16 on the CPU (bfloat16 when a prefix value
    # exceeds the float16 range), the model's dtype elsewhere.
    # paged storage: auto (as dense) | fp8_e4m3 | fp8_e5m2 | bfloat16 | float16 | float32
    backend: str = "auto"  # kernels backend: auto | ref | triton
    weights: str = "model"  # the draft forward's weights: model | bfloat16 | int8 (weights.py)

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"draft layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.dtype not in (PAGED_DTYPES if self.layout == "paged" else DTYPES):
            raise ValueError(
                f"draft dtype for layout {self.layout!r} must be one of "
                f"{PAGED_DTYPES if self.layout == 'paged' else tuple(DTYPES)}, got {self.dtype!r}"
            )
        if self.backend not in BACKENDS:
            raise ValueError(f"draft backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.weights not in WEIGHTS:
            raise ValueError(f"draft weights must be one of {WEIGHTS}, got {self.weights!r}")

    def resolve_layout(self, device: torch.device | str) -> str:
        if self.layout != "auto":
            return self.layout
        if use_triton(self.backend, torch.empty(0, device=device)):
            return "packed"
        cpu = torch.device(device).type == "cpu" and self.backend == "auto" and self.dtype in PAGED_DTYPES
        return "paged" if cpu and vllm_cpu_attention_available(self.paged_dtype) else "dense"

    @property
    def paged_dtype(self) -> str:
        """The paged storage dtype ("auto": float16, or bfloat16 where float16 overflows: see dense.py)."""
        return "float16" if self.dtype == "auto" else self.dtype

    def describe(self, device: torch.device | str) -> str:
        """e.g. "paged/model": the resolved layout and the draft weights."""
        return f"{self.resolve_layout(device)}/{self.weights}"
