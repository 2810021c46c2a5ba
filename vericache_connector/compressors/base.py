"""The compressor interface: one prefix's KV in, one compressed object out.

A compressor is a dataclass with one method, ``compress(prefix) -> CompressedKV`` (kvpress style).
The compressed object counts its real stored bytes (``nbytes``), attends (``layer_kv`` gives keys and
values an attention op can use: dequantized, or the kept positions) and serializes to a layered
payload (``to_payload``/``from_payload``) that the dual-copy store writes layer by layer.

A compressed copy read back from a store passed its checksums, but it may still not fit: another
compressor's tensors under this spec, a meta that disagrees with its tensors, another model's layer
count. ``Compressor.validate`` checks a decoded copy against the model and against what this compressor
makes of a prefix of that length, before anything attends over it; a failure is a ValueError, which
the readers (the remote prefix cache, the vLLM worker) treat as a miss.
"""

from __future__ import annotations

import threading
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
    token_ids: the prompt's token ids (kvpress presses re-run the model on them: compressors/press.py).
    inv_freq: [D/2] the RoPE inverse frequencies the keys were rotated with (pre-RoPE quantizers
    undo the rotation: compressors/kvquant.py). Both None when the caller has none.
    """

    keys: list[Tensor]
    values: list[Tensor]
    obs_queries: list[Tensor] | None = None
    token_ids: list[int] | None = None
    inv_freq: Tensor | None = None

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

    def validate(self, compressed: "CompressedKV", num_tokens: int, num_layers: int, num_kv_heads: int, head_dim: int):
        """Raise ValueError unless `compressed` is exactly what this compressor makes of a prefix of
        `num_tokens` tokens of a model with this KV shape: its spec, its meta (compressor name, bits,
        groups, kept count, ...), one layer per model layer, each with the same tensor names, dtypes and
        shapes, float tensors finite, kept positions (token dropping) in range and increasing.

        The expected layout is not written out per compressor: it is what `compress` gives a zero
        prefix of this shape (one layer; cached), so it cannot drift from the code that writes copies.
        A compressor whose compress needs more than KV (a model run, RoPE frequencies) or whose shapes
        depend on the data overrides this, with check_header / check_tensors below."""
        meta, shapes = _reference_layout(self, num_tokens, num_kv_heads, head_dim)
        check_header(compressed, self.spec, meta, num_layers)
        for i, layer in enumerate(compressed.layers):
            check_tensors(i, layer, shapes)
            idx = layer.get("idx")
            if idx is not None and idx.numel():
                if int(idx.min()) < 0 or int(idx.max()) >= num_tokens:
                    raise ValueError(f"compressed copy layer {i}: kept positions outside [0, {num_tokens})")
                if idx.shape[-1] > 1 and not bool((idx[..., 1:] > idx[..., :-1]).all()):
                    raise ValueError(f"compressed copy layer {i}: kept positions are not increasing")


def check_header(compressed: "CompressedKV", spec: str, meta: dict, num_layers: int) -> None:
    """A decoded copy is a LayeredKV of this spec, with exactly this meta and one layer per model layer."""
    if not isinstance(compressed, LayeredKV):
        raise ValueError(f"compressed copy is a {type(compressed).__name__}, expected LayeredKV")
    if compressed.spec != spec:
        raise ValueError(f"compressed copy has spec {compressed.spec!r}, expected {spec!r}")
    if compressed.meta != meta:
        raise ValueError(f"compressed copy's meta {compressed.meta!r} does not match {meta!r}")
    if compressed.num_layers != num_layers:
        raise ValueError(f"compressed copy has {compressed.num_layers} layers, the model {num_layers}")


def check_tensors(i: int, layer: Any, shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
    """Layer i holds exactly the tensors of `shapes` ({name: (dtype, shape)}), floating ones finite."""
    if not isinstance(layer, dict) or sorted(layer) != sorted(shapes):
        names = sorted(layer) if isinstance(layer, dict) else type(layer).__name__
        raise ValueError(f"compressed copy layer {i} has tensors {names}, expected {sorted(shapes)}")
    for name, t in layer.items():
        dtype, shape = shapes[name]
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != tuple(shape):
            got = (t.dtype, tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"compressed copy layer {i} {name!r} is {got}, expected {(dtype, tuple(shape))}")
        if t.is_floating_point() and not bool(torch.isfinite(t.float()).all()):
            raise ValueError(f"compressed copy layer {i} {name!r} holds NaN or inf")


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
        if not isinstance(meta, dict) or not isinstance(meta.get("spec"), str):
            raise ValueError(f"compressed payload meta names no spec: {meta!r}")
        if not isinstance(layers, list):
            raise ValueError(f"compressed payload layers are a {type(layers).__name__}, expected a list")
        meta = dict(meta)
        return cls(meta.pop("spec"), meta, layers)


_LAYOUTS: dict[tuple, tuple[dict, dict]] = {}
_LAYOUTS_LOCK = threading.Lock()


def _reference_layout(c: Compressor, num_tokens: int, heads: int, head_dim: int) -> tuple[dict, dict]:
    """(meta, {tensor name: (dtype, shape)}) of what c.compress makes of one layer of a zero prefix."""
    if not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"a compressed copy covers >= 1 token, got num_tokens={num_tokens!r}")
    key = (c.spec, num_tokens, heads, head_dim)
    with _LAYOUTS_LOCK:
        if key in _LAYOUTS:
            return _LAYOUTS[key]
    zeros = torch.zeros(heads, num_tokens, head_dim)
    obs = [torch.zeros(heads, min(num_tokens, 32), head_dim)] if c.needs_queries else None
    ref = c.compress(PrefixKV([zeros], [zeros], obs))
    layout = ref.meta, {name: (t.dtype, tuple(t.shape)) for name, t in ref.layers[0].items()}
    with _LAYOUTS_LOCK:
        if len(_LAYOUTS) > 256:
            _LAYOUTS.clear()
        _LAYOUTS[key] = layout
    return layout
