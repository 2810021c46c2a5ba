"""Layered payloads: (meta, [ {name: tensor} per layer ]) <-> bytes.

Layout: b"VCLP" | u32 little-endian header length | header JSON | layer blobs.
Each layer blob is one safetensors file, so any single layer can be fetched with
a byte-range read and decoded on its own. The header holds ``meta`` and each
layer's (offset, length), offsets counted from the start of the payload.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from .base import CorruptObject

MAGIC = b"VCLP"
_PREFIX = struct.Struct("<4sI")
FORMAT_VERSION = 1


@dataclass(frozen=True)
class LayerSpan:
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A CPU, contiguous tensor that owns exactly its bytes (safetensors needs it)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"layer values must be torch.Tensor, got {type(t).__name__}")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset():
        t = t.clone()
    return t


def encode_layer(layer: Mapping[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    if not isinstance(layer, Mapping):
        raise ValueError(f"a layer must be a dict of tensors, got {type(layer).__name__}")
    return save({str(k): _plain(v) for k, v in layer.items()})


def decode_layer(blob: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    try:
        return load(bytes(blob))
    except Exception as e:  # safetensors raises its own error types
        raise CorruptObject(f"layer blob does not decode: {type(e).__name__}: {e}") from e


def serialize(
    meta: Mapping[str, Any] | None, layers: Sequence[Mapping[str, torch.Tensor]]
) -> tuple[bytes, list[LayerSpan]]:
    """Bytes of the payload and the absolute span of each layer inside it."""
    blobs = [encode_layer(layer) for layer in layers]
    rel, pos = [], 0
    for b in blobs:
        rel.append([pos, len(b)])
        pos += len(b)
    try:
        header = json.dumps(
            {"v": FORMAT_VERSION, "meta": dict(meta or {}), "layers": rel},
            separators=(",", ":"),
            sort_keys=True,
        ).encode()
    except TypeError as e:
        raise ValueError(f"meta is not JSON-serializable: {e}") from e
    start = _PREFIX.size + len(header)
    spans = [LayerSpan(start + o, n) for o, n in rel]
    return b"".join([_PREFIX.pack(MAGIC, len(header)), header, *blobs]), spans


def read_header(data: bytes) -> tuple[dict, list[LayerSpan]]:
    """(meta, layer spans) from the start of a payload."""
    if len(data) < _PREFIX.size:
        raise CorruptObject(f"payload too short ({len(data)} bytes)")
    magic, hlen = _PREFIX.unpack_from(data, 0)
    if magic != MAGIC:
        raise CorruptObject(f"bad payload magic {magic!r}")
    if len(data) < _PREFIX.size + hlen:
        raise CorruptObject(f"payload header truncated ({len(data)} < {_PREFIX.size + hlen})")
    try:
        header = json.loads(bytes(data[_PREFIX.size : _PREFIX.size + hlen]))
        if not isinstance(header, dict) or header.get("v") != FORMAT_VERSION or not isinstance(header["meta"], dict):
            raise ValueError("not a layered payload header of this version")
        start = _PREFIX.size + hlen
        spans = []
        for o, n in header["layers"]:
            if not (type(o) is int and type(n) is int and o >= 0 and n >= 0):
                raise ValueError(f"bad layer span ({o!r}, {n!r})")
            spans.append(LayerSpan(start + o, n))
        return header["meta"], spans
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise CorruptObject(f"payload header does not parse: {type(e).__name__}: {e}"[:500]) from None


def deserialize(data: bytes) -> tuple[dict, list[dict[str, torch.Tensor]]]:
    meta, spans = read_header(data)
    need = max((s.end for s in spans), default=0)
    if need > len(data):
        raise CorruptObject(f"payload truncated: {len(data)} bytes, layers need {need}")
    view = memoryview(data)
    return meta, [decode_layer(view[s.offset : s.end]) for s in spans]
