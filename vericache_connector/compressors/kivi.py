"""KIVI (Liu et al. 2024): asymmetric low-bit quantization, keys per-channel, values per-token.

Keys have outlier channels, so each channel gets its own min/scale over a group of `group` tokens;
values are quantized per token over runs of `value_group` channels. Codes are REALLY bit-packed
(kernels.kivi / kernels.bitpack; 2 bits -> 4 codes a byte); scales/mins are float16. The newest
tokens that do not fill a whole key group, and at least `residual` of them, stay full precision
(float16) as KIVI's residual window. nbytes counts exactly these stored tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vericache_kernels.kivi import (
    kivi_dequantize_keys,
    kivi_dequantize_values,
    kivi_quantize_keys,
    kivi_quantize_values,
    kivi_split,
)

from .base import Compressor, LayeredKV, PrefixKV

RESIDUAL_DTYPE = torch.float16


@dataclass
class KIVICompressor(Compressor):
    name = "kivi"
    bits: int = 4
    group: int = 32  # tokens per key group (per-channel quantization)
    value_group: int = 16  # channels per value group (per-token); 16 = 4 groups per 64-dim head
    residual: int = 128  # newest tokens kept in full precision (KIVI paper: R=128, G=32)

    def __post_init__(self):
        if self.bits not in (2, 3, 4, 8):
            raise ValueError(f"kivi: bits must be 2, 3, 4 or 8, got {self.bits!r}")
        if self.group < 1 or self.value_group < 1 or self.residual < 0:
            raise ValueError(
                f"kivi: group/value_group must be >= 1 and residual >= 0, got group={self.group}, "
                f"value_group={self.value_group}, residual={self.residual}"
            )

    def compress(self, prefix: PrefixKV) -> LayeredKV:
        d = prefix.keys[0].shape[-1]
        if d % self.value_group:
            raise ValueError(f"kivi: value_group {self.value_group} does not divide head_dim {d}")
        n_q = kivi_split(prefix.num_tokens, self.group, self.residual)
        layers = []
        for k, v in zip(prefix.keys, prefix.values):
            kp, ks, km = kivi_quantize_keys(k[:, :n_q], self.bits, self.group)
            vp, vs, vm = kivi_quantize_values(v[:, :n_q], self.bits, self.value_group)
            layers.append(
                {
                    "k": kp,
                    "k_scale": ks,
                    "k_mn": km,
                    "v": vp,
                    "v_scale": vs,
                    "v_mn": vm,
                    "k_tail": k[:, n_q:].to(RESIDUAL_DTYPE).contiguous(),
                    "v_tail": v[:, n_q:].to(RESIDUAL_DTYPE).contiguous(),
                }
            )
        meta = {
            "compressor": self.name,
            "num_tokens": prefix.num_tokens,
            "bits": self.bits,
            "group": self.group,
            "value_group": self.value_group,
            "quantized_tokens": n_q,
        }
        return LayeredKV(self.spec, meta, layers)

    @staticmethod
    def decode(meta, t, dtype):
        bits = meta["bits"]
        k = kivi_dequantize_keys(t["k"], t["k_scale"], t["k_mn"], bits, meta["group"], torch.float32)
        v = kivi_dequantize_values(t["v"], t["v_scale"], t["v_mn"], bits, meta["value_group"], torch.float32)
        return (torch.cat([k, t["k_tail"].float()], 1).to(dtype), torch.cat([v, t["v_tail"].float()], 1).to(dtype))


COMPRESSOR = KIVICompressor
