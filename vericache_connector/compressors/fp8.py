"""fp8 (e4m3): per-token scaled cast. scale = max|x| / 448 (the largest finite e4m3 value), stored as
float16; x ~= fp8(x / scale) * scale. One byte per element plus 2 bytes per (head, token) vector."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Compressor, LayeredKV, PrefixKV

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (x.float().abs().amax(-1, keepdim=True) / FP8_MAX).to(torch.float16)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale).float()
    return (x.float() / safe).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


@dataclass
class FP8Compressor(Compressor):
    name = "fp8"

    def compress(self, prefix: PrefixKV) -> LayeredKV:
        layers = []
        for k, v in zip(prefix.keys, prefix.values):
            kq, ks = quantize_fp8(k)
            vq, vs = quantize_fp8(v)
            layers.append({"k": kq, "k_scale": ks, "v": vq, "v_scale": vs})
        return LayeredKV(self.spec, {"compressor": self.name, "num_tokens": prefix.num_tokens}, layers)

    @staticmethod
    def decode(meta, t, dtype):
        return ((t["k"].float() * t["k_scale"].float()).to(dtype),
                (t["v"].float() * t["v_scale"].float()).to(dtype))


COMPRESSOR = FP8Compressor
