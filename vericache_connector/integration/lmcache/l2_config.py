"""Settings of the LMCache L2 adapter (integration/lmcache/l2_adapter.py) and LMCache's KV layout <-> ours.

adapter_params (``--l2-adapter '{"type": "plugin", ..., "adapter_params": {...}}'``) -> L2Settings:

  url           any open_backend URL (redis://, rediss://, s3://, local://, nixl://); shown redacted.
                Default: env VERICACHE_STORE_URL (from a Secret: a URL with a password stays off argv)
  kv_dtype      the model's KV dtype ("bfloat16", "float16", "float32"): part of every key
  compressor    spec of the compressed copy written for each stored prefix (default "kivi4"; null: full
                copies only). The adapter has the KV and nothing else: a compressor that needs the
                prompt's queries (SnapKV, TOVA), its token ids and a model (kvpress presses) or RoPE
                frequencies (kvquant) is refused.
  max_compress_tokens  longest prefix the adapter reads back to compress (default 32768); a longer one
                gets its compressed copy from the first VeriCache reader instead (it writes it back)
  head_dim      splits LMCache's heads*head_dim; default: model_dir's config.json
  model_id | model_dir (+ model_name), served_model   the model's VeriCache id (lmcache_keys)
  mac_key_file  the MAC key (else env VERICACHE_MAC_KEY_FILE / VERICACHE_MAC_KEY; none: checksums only)
  timeout_s     every store operation (default 5)
  chunk_size    the server's --chunk-size (default 256): a VeriCache reader must use the same

LMCache's object for one chunk of a vLLM model (MemoryFormat.KV_2LTD): one tensor [2, layers, tokens,
heads*head_dim], K then V. Ours: per layer {"k": [heads, tokens, head_dim], "v": ...}.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase

from storage_backends.credentials import redact_url
from storage_backends.keys import dtype_str, torch_dtype

_INTS = ("head_dim", "chunk_size", "max_compress_tokens")
URL_ENV = "VERICACHE_STORE_URL"


@dataclass
class L2Settings:
    url: str
    kv_dtype: str
    compressor: str | None = "kivi4"
    max_compress_tokens: int = 32768
    head_dim: int | None = None
    model_id: str | None = None
    model_dir: str | None = None
    model_name: str | None = None
    served_model: str | None = None
    mac_key_file: str | None = None
    timeout_s: float = 5.0
    chunk_size: int = 256

    @classmethod
    def from_params(cls, params: dict) -> "L2Settings":
        if not isinstance(params, dict):
            raise ValueError(f"adapter_params must be a JSON object, got {type(params).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(params) - set(known))
        if unknown:
            raise ValueError(f"unknown adapter_params {unknown}; known: {known}")
        if "url" not in params and os.environ.get(URL_ENV):
            params = {**params, "url": os.environ[URL_ENV]}
        for name in ("url", "kv_dtype"):
            if not isinstance(params.get(name), str) or not params[name]:
                more = f" (or env {URL_ENV})" if name == "url" else ""
                raise ValueError(f"adapter_params needs {name!r}{more}, a non-empty string")
        for name, value in params.items():
            want = (int, float) if name == "timeout_s" else int if name in _INTS else str
            if value is not None and (isinstance(value, bool) or not isinstance(value, want)):
                shown = redact_url(value) if name == "url" else repr(value)
                raise ValueError(f"adapter_params[{name!r}] has the wrong type: {shown}")
        return cls(**params)

    def __post_init__(self):
        dtype_str(self.kv_dtype)  # ValueError naming it
        for name in ("timeout_s", *_INTS):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"adapter_params[{name!r}] must be > 0, got {value!r}")
        if self.head_dim is None and self.model_dir is None:
            raise ValueError("adapter_params needs head_dim (or model_dir, whose config.json gives it)")

    @property
    def dtype(self) -> torch.dtype:
        return torch_dtype(self.kv_dtype)

    def resolved_head_dim(self) -> int:
        if self.head_dim is not None:
            return self.head_dim
        path = Path(self.model_dir).expanduser() / "config.json"
        try:
            cfg = json.loads(path.read_text())
            return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
        except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as e:
            raise ValueError(
                f"no head_dim in {str(path)!r} ({type(e).__name__}): set adapter_params head_dim"
            ) from None

    def __repr__(self) -> str:
        shown = (
            f"{f.name}={redact_url(self.url) if f.name == 'url' else repr(getattr(self, f.name))}" for f in fields(self)
        )
        return f"L2Settings({', '.join(shown)})"


class VeriCacheL2AdapterConfig(L2AdapterConfigBase):
    """LMCache's plugin factory finds it by name (class_name + "Config") and builds it from adapter_params."""

    def __init__(self, settings: L2Settings):
        self.settings = settings

    @classmethod
    def from_dict(cls, d: dict) -> "VeriCacheL2AdapterConfig":
        return cls(L2Settings.from_params(d))

    @classmethod
    def help(cls) -> str:
        return __doc__ or ""


def store_compressor(spec: str | None, head_dim: int):
    """The compressor, checked to run on KV alone (the adapter has no model, queries or token ids)."""
    if spec is None:
        return None
    from ...compressors import PrefixKV, get_compressor

    comp = get_compressor(spec)
    probe = PrefixKV([torch.randn(1, 64, head_dim)], [torch.randn(1, 64, head_dim)])
    try:
        if comp.needs_queries:
            raise ValueError("it scores positions with the prompt's queries")
        comp.compress(probe)
    except Exception as e:
        raise ValueError(f"compressor {spec!r} cannot run in the L2 adapter, which has the KV only: {e}") from None
    return comp


class Unfit(ValueError):
    """An LMCache object or key this adapter does not store (logged; skipped, or a miss)."""


def kv_layout(obj, dtype: torch.dtype, head_dim: int, chunk_size: int) -> tuple[int, int, int]:
    """(layers, tokens, heads) of a KV_2LTD object of this dtype; Unfit otherwise."""
    meta = obj.metadata
    shapes, dtypes = list(meta.shapes or [meta.shape]), list(meta.dtypes or [meta.dtype])
    if len(shapes) != 1 or len(shapes[0]) != 4 or shapes[0][0] != 2:
        raise Unfit(f"object of shapes {[tuple(s) for s in shapes]} is not [2, layers, tokens, heads*head_dim]")
    _, layers, tokens, hd = shapes[0]
    if dtypes[0] != dtype or hd % head_dim or not 0 < tokens <= chunk_size:
        raise Unfit(
            f"object {dtypes[0]}{tuple(shapes[0])} is not of {dtype}, head_dim {head_dim}, <= {chunk_size} tokens"
        )
    return layers, tokens, hd // head_dim


def to_layers(t: torch.Tensor, head_dim: int) -> list[dict[str, torch.Tensor]]:
    """LMCache's [2, L, T, H*D] -> per layer {"k": [H, T, D], "v": [H, T, D]} (views)."""
    _, layers, tokens, hd = t.shape
    kv = t.view(2, layers, tokens, hd // head_dim, head_dim).transpose(2, 3)
    return [{"k": kv[0, i], "v": kv[1, i]} for i in range(layers)]


def fill(t: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Per layer (k, v) [H, T, D] -> into LMCache's [2, L, T, H*D]."""
    for i, (k, v) in enumerate(layers):
        t[0, i].view(k.shape[1], k.shape[0], k.shape[2]).copy_(k.transpose(0, 1))
        t[1, i].view(v.shape[1], v.shape[0], v.shape[2]).copy_(v.transpose(0, 1))
