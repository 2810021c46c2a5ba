"""Shared part of per-token scaled quantizers (int8, fp8): every (head, token) vector x of K and V is
stored as codes of x / scale plus one float16 scale, and restored as codes * scale."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Compressor, LayeredKV, PrefixKV

Tensor = torch.Tensor


def per_token_scale(x: Tensor, max_code: float) -> tuple[Tensor, Tensor]:
    """(float16 scale = max|x| / max_code per vector, the float32 divisor with 0 replaced by 1)."""
    scale = (x.float().abs().amax(-1, keepdim=True) / max_code).to(torch.float16)
    return scale, torch.where(scale == 0, torch.ones_like(scale), scale).float()


@dataclass
class ScaledCompressor(Compressor):
    @staticmethod
    def quantize(x: Tensor) -> tuple[Tensor, Tensor]:
        """x [H, T, D] -> (codes [H, T, D], float16 scales [H, T, 1])."""
        raise NotImplementedError

    def compress(self, prefix: PrefixKV) -> LayeredKV:
        layers = []
        for k, v in zip(prefix.keys, prefix.values):
            kq, ks = self.quantize(k)
            vq, vs = self.quantize(v)
            layers.append({"k": kq, "k_scale": ks, "v": vq, "v_scale": vs})
        return LayeredKV(self.spec, {"compressor": self.name, "num_tokens": prefix.num_tokens}, layers)

    @staticmethod
    def decode(meta, t, dtype):
        return ((t["k"].float() * t["k_scale"].float()).to(dtype), (t["v"].float() * t["v_scale"].float()).to(dtype))
