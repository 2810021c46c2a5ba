"""KVQuant-style (Hooper et al. 2024): keys quantized per channel BEFORE RoPE, values per token, with
dense-and-sparse outliers and the attention sink in full precision (format: kernels/kvquant.py).

  * the first `sink` tokens stay float16 (attention-sink aware: they draw a large share of attention);
  * keys: un-rotated with the model's RoPE frequencies (PrefixKV.inv_freq), per-channel range over the
    remaining tokens minus `outliers / 2` of them at each end, which are kept sparse (position + float16
    residual); codes at `bits`, bit-packed like KIVI;
  * values: the same per token over the head's D channels.
Not implemented from the paper: its non-uniform (sensitivity-weighted k-means) levels and offline
calibration; the levels are uniform and the ranges come from the prefix itself.
nbytes counts exactly the stored tensors; the RoPE frequencies travel in meta (JSON floats).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vericache_kernels.kvquant import (
    kvquant_dequantize_keys,
    kvquant_dequantize_values,
    kvquant_quantize_keys,
    kvquant_quantize_values,
)

from .base import Compressor, LayeredKV, PrefixKV

SINK_DTYPE = torch.float16


@dataclass
class KVQuantCompressor(Compressor):
    name = "kvquant"
    bits: int = 4
    outliers: float = 0.01  # fraction per channel (keys) / per token (values) kept sparse, half at each end
    sink: int = 1  # first tokens kept in float16

    def __post_init__(self):
        if self.bits not in (2, 3, 4, 8):
            raise ValueError(f"kvquant: bits must be 2, 3, 4 or 8, got {self.bits!r}")
        if not (isinstance(self.outliers, (int, float)) and 0 <= self.outliers < 0.5):
            raise ValueError(f"kvquant: outliers must be a fraction in [0, 0.5), got {self.outliers!r}")
        if not isinstance(self.sink, int) or self.sink < 0:
            raise ValueError(f"kvquant: sink must be an int >= 0, got {self.sink!r}")

    def split(self, num_tokens: int, head_dim: int) -> tuple[int, int, int]:
        """(sink tokens, key outliers per side per channel, value outliers per side per token)."""
        s = min(self.sink, num_tokens - 1)
        return s, math.floor(self.outliers / 2 * (num_tokens - s)), math.floor(self.outliers / 2 * head_dim)

    def compress(self, prefix: PrefixKV) -> LayeredKV:
        if prefix.inv_freq is None:
            raise ValueError("kvquant needs the model's RoPE frequencies (PrefixKV.inv_freq) to un-rotate the keys")
        t, d = prefix.num_tokens, prefix.keys[0].shape[-1]
        inv = prefix.inv_freq.float().cpu()
        s, mk, mv = self.split(t, d)
        layers = []
        for k, v in zip(prefix.keys, prefix.values):
            kq = kvquant_quantize_keys(k[:, s:], inv.to(k.device), self.bits, mk, pos0=s)
            vq = kvquant_quantize_values(v[:, s:], self.bits, mv)
            layer = {f"k_{n}": x for n, x in kq.items()} | {f"v_{n}": x for n, x in vq.items()}
            layer["k_sink"] = k[:, :s].to(SINK_DTYPE).contiguous()
            layer["v_sink"] = v[:, :s].to(SINK_DTYPE).contiguous()
            layers.append(layer)
        meta = {
            "compressor": self.name,
            "num_tokens": t,
            "bits": self.bits,
            "sink": s,
            "key_outliers": mk,
            "value_outliers": mv,
            "inv_freq": [float(x) for x in inv],
        }
        return LayeredKV(self.spec, meta, layers)

    @staticmethod
    def decode(meta, t, dtype):
        bits, s = meta["bits"], meta["sink"]
        inv = torch.tensor(meta["inv_freq"], dtype=torch.float32, device=t["k_packed"].device)
        kq = {n[2:]: x for n, x in t.items() if n.startswith("k_") and n != "k_sink"}
        vq = {n[2:]: x for n, x in t.items() if n.startswith("v_") and n != "v_sink"}
        k = kvquant_dequantize_keys(kq, inv, bits, pos0=s)
        v = kvquant_dequantize_values(vq, bits)
        return torch.cat([t["k_sink"].float(), k], 1).to(dtype), torch.cat([t["v_sink"].float(), v], 1).to(dtype)

    def layout(self, num_tokens: int, heads: int, head_dim: int) -> dict[str, tuple[torch.dtype, tuple]]:
        """{tensor name: (dtype, shape)} of one layer of a `num_tokens` prefix."""
        s, mk, mv = self.split(num_tokens, head_dim)
        n, nb, f16 = num_tokens - s, head_dim * self.bits // 8, torch.float16
        return {
            "k_packed": (torch.uint8, (heads, n, nb)),
            "k_scale": (f16, (heads, 1, head_dim)),
            "k_mn": (f16, (heads, 1, head_dim)),
            "k_out_pos": (torch.int32, (heads, 2 * mk, head_dim)),
            "k_out_val": (f16, (heads, 2 * mk, head_dim)),
            "v_packed": (torch.uint8, (heads, n, nb)),
            "v_scale": (f16, (heads, n, 1)),
            "v_mn": (f16, (heads, n, 1)),
            "v_out_pos": (torch.int32, (heads, n, 2 * mv)),
            "v_out_val": (f16, (heads, n, 2 * mv)),
            "k_sink": (SINK_DTYPE, (heads, s, head_dim)),
            "v_sink": (SINK_DTYPE, (heads, s, head_dim)),
        }

    def validate(self, compressed, num_tokens: int, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        """As Compressor.validate (which would need RoPE frequencies to compress a reference prefix): the
        layout is computed, the frequencies must be head_dim / 2 finite floats."""
        if not isinstance(compressed, LayeredKV):
            raise ValueError(f"compressed copy is a {type(compressed).__name__}, expected LayeredKV")
        if compressed.spec != self.spec:
            raise ValueError(f"compressed copy has spec {compressed.spec!r}, expected {self.spec!r}")
        if not isinstance(num_tokens, int) or num_tokens < 1:
            raise ValueError(f"a compressed copy covers >= 1 token, got num_tokens={num_tokens!r}")
        inv = compressed.meta.get("inv_freq")
        if (
            not isinstance(inv, list)
            or len(inv) != head_dim // 2
            or not all(isinstance(x, float) and math.isfinite(x) for x in inv)
        ):
            raise ValueError(f"compressed copy's inv_freq is not {head_dim // 2} finite floats")
        s, mk, mv = self.split(num_tokens, head_dim)
        meta = {
            "compressor": self.name,
            "num_tokens": num_tokens,
            "bits": self.bits,
            "sink": s,
            "key_outliers": mk,
            "value_outliers": mv,
            "inv_freq": inv,
        }
        if compressed.meta != meta:
            raise ValueError(f"compressed copy's meta {compressed.meta!r} does not match {meta!r}")
        if compressed.num_layers != num_layers:
            raise ValueError(f"compressed copy has {compressed.num_layers} layers, the model {num_layers}")
        shapes = self.layout(num_tokens, num_kv_heads, head_dim)
        bounds = {"k_out_pos": num_tokens - s, "v_out_pos": head_dim}
        for i, layer in enumerate(compressed.layers):
            if not isinstance(layer, dict) or sorted(layer) != sorted(shapes):
                names = sorted(layer) if isinstance(layer, dict) else type(layer).__name__
                raise ValueError(f"compressed copy layer {i} has tensors {names}, expected {sorted(shapes)}")
            for name, x in layer.items():
                dtype, shape = shapes[name]
                if not isinstance(x, torch.Tensor) or x.dtype != dtype or tuple(x.shape) != shape:
                    got = (x.dtype, tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__
                    raise ValueError(f"compressed copy layer {i} {name!r} is {got}, expected {(dtype, shape)}")
                if x.is_floating_point() and not bool(torch.isfinite(x.float()).all()):
                    raise ValueError(f"compressed copy layer {i} {name!r} holds NaN or inf")
                if name in bounds and x.numel() and (int(x.min()) < 0 or int(x.max()) >= bounds[name]):
                    raise ValueError(f"compressed copy layer {i} {name!r} points outside [0, {bounds[name]})")


COMPRESSOR = KVQuantCompressor
