"""The compressor interface: one prefix's KV in, one compressed object out.

A compressor is a dataclass with one method, ``compress(prefix) -> CompressedKV`` (kvpress style).
The compressed object counts its real stored bytes (``nbytes``), attends (``layer_kv`` gives keys and
values an attention op can use: dequantized, or the kept positions) and serializes to a layered
payload (``to_payload``/``from_payload``) that the dual-copy store writes layer by layer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import Any

import torch

Tensor = torch.Tensor


@dataclass
class PrefixKV:
    """Full-precision KV of one prefix, as prefill produced it.

    keys/values: per layer [H_kv, T, D], keys already rotated by RoPE at their true positions.
    obs_queries: per layer [H_q, W, D], the last W post-RoPE queries of the prefix (SnapKV/TOVA
    score the prefix with them); None when the caller has none (query-free compressors only).
    """

    keys: list[Tensor]
    values: list[Tensor]
    obs_queries: list[Tensor] | None = None

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def num_tokens(self) -> int:
        return self.keys[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values))


class CompressedKV(ABC):
    """One prefix's compressed KV. Subclasses hold per-layer tensors and a JSON-able meta dict."""

    spec: str  # the compressor spec string that made it, e.g. "kivi:bits=4"

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of what is stored (packed codes, scales, kept K/V, indices)."""

    @property
    @abstractmethod
    def num_layers(self) -> int: ...

    @abstractmethod
    def layer_kv(self, layer: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Keys and values [H_kv, L, D] to attend over (L = kept tokens; post-RoPE keys)."""

    @abstractmethod
    def to_payload(self) -> tuple[dict[str, Any], list[dict[str, Tensor]]]:
        """(meta, one dict of tensors per layer): what the store writes."""

    @classmethod
    @abstractmethod
    def from_payload(cls, meta: dict[str, Any], layers: list[dict[str, Tensor]]) -> "CompressedKV": ...


@dataclass
class Compressor(ABC):
    """Base of every compressor config. Subclasses are dataclasses with validated fields."""

    name = "base"

    @abstractmethod
    def compress(self, prefix: PrefixKV) -> CompressedKV: ...

    @property
    def needs_queries(self) -> bool:
        return False

    @property
    def spec(self) -> str:
        """Canonical string naming this compressor and its settings (used in store keys)."""
        fields = ",".join(f"{k}={v}" for k, v in sorted(asdict(self).items()))
        return f"{self.name}:{fields}" if fields else self.name


class LayeredKV(CompressedKV):
    """The one CompressedKV used by every compressor: a meta dict plus a dict of tensors per layer.

    What a layer's tensors mean (packed codes + scales, or kept keys/values + positions) is known to
    the compressor class named in meta["compressor"]; its `decode(meta, tensors, dtype)` turns them back
    into attendable keys/values. nbytes counts exactly the tensors that are stored.
    """

    def __init__(self, spec: str, meta: dict[str, Any], layers: list[dict[str, Tensor]]):
        self.spec, self.meta, self.layers = spec, meta, layers

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for layer in self.layers for t in layer.values())

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_kv(self, layer: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        from . import compressor_class

        return compressor_class(self.meta["compressor"]).decode(self.meta, self.layers[layer], dtype)

    def to_payload(self) -> tuple[dict[str, Any], list[dict[str, Tensor]]]:
        return {**self.meta, "spec": self.spec}, self.layers

    @classmethod
    def from_payload(cls, meta: dict[str, Any], layers: list[dict[str, Tensor]]) -> "LayeredKV":
        meta = dict(meta)
        return cls(meta.pop("spec"), meta, layers)
