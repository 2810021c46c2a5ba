"""int8: symmetric per-token quantization of keys and values.

For each (head, token) vector x: scale = max|x| / 127, code = round(x / scale) in [-127, 127];
stored as int8 codes plus one float16 scale per vector (D + 2 bytes per 2*D-byte fp16 vector).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Compressor, LayeredKV, PrefixKV


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (x.float().abs().amax(-1, keepdim=True) / 127).to(torch.float16)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale).float()
    return (x.float() / safe).round().clamp(-127, 127).to(torch.int8), scale


@dataclass
class Int8Compressor(Compressor):
    name = "int8"

    def compress(self, prefix: PrefixKV) -> LayeredKV:
        layers = []
        for k, v in zip(prefix.keys, prefix.values):
            kq, ks = quantize_int8(k)
            vq, vs = quantize_int8(v)
            layers.append({"k": kq, "k_scale": ks, "v": vq, "v_scale": vs})
        return LayeredKV(self.spec, {"compressor": self.name, "num_tokens": prefix.num_tokens}, layers)

    @staticmethod
    def decode(meta, t, dtype):
        return ((t["k"].float() * t["k_scale"].float()).to(dtype),
                (t["v"].float() * t["v_scale"].float()).to(dtype))


COMPRESSOR = Int8Compressor
