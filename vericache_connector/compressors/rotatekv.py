"""RotateKV-style 2-bit KV (Su et al. 2025): a randomized Hadamard rotation per head, then per-token
low-bit quantization of keys and values, with the attention sinks in full precision (format:
kernels/rotatekv.py).

The rotation spreads the few large key channels over all D channels, so keys can be quantized per token
like values (KIVI has to quantize keys per channel instead). The first `sink` tokens stay float16.
Codes are bit-packed like KIVI's (2 bits: 4 codes a byte), scale/mn float16 per `group` channels of a
token. Not implemented from the paper: its outlier-aware channel reordering before a grouped
Hadamard transform and the pre-RoPE grouped-head rotation (the rotation here is per head, after RoPE).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vericache_kernels.rotatekv import rotatekv_dequantize, rotatekv_quantize

from .base import Compressor, LayeredKV, PrefixKV

SINK_DTYPE = torch.float16


@dataclass
class RotateKVCompressor(Compressor):
    name = "rotatekv"
    bits: int = 2
    group: int = 32  # channels per scale/mn (per token)
    sink: int = 4  # first tokens kept in float16
    seed: int = 0  # random signs of the Hadamard rotation

    def __post_init__(self):
        if self.bits not in (2, 3, 4, 8):
            raise ValueError(f"rotatekv: bits must be 2, 3, 4 or 8, got {self.bits!r}")
        if not isinstance(self.group, int) or self.group < 1:
            raise ValueError(f"rotatekv: group must be an int >= 1, got {self.group!r}")
        if not isinstance(self.sink, int) or self.sink < 0:
            raise ValueError(f"rotatekv: sink must be an int >= 0, got {self.sink!r}")

    def compress(self, prefix: PrefixKV) -> LayeredKV:
        d = prefix.keys[0].shape[-1]
        if d % self.group:
            raise ValueError(f"rotatekv: group {self.group} does not divide head_dim {d}")
        s = min(self.sink, prefix.num_tokens)
        layers = []
        for k, v in zip(prefix.keys, prefix.values):
            kp, ks, km = rotatekv_quantize(k[:, s:], self.bits, self.group, self.seed)
            vp, vs, vm = rotatekv_quantize(v[:, s:], self.bits, self.group, self.seed + 1)
            layers.append(
                {
                    "k": kp,
                    "k_scale": ks,
                    "k_mn": km,
                    "v": vp,
                    "v_scale": vs,
                    "v_mn": vm,
                    "k_sink": k[:, :s].to(SINK_DTYPE).contiguous(),
                    "v_sink": v[:, :s].to(SINK_DTYPE).contiguous(),
                }
            )
        meta = {
            "compressor": self.name,
            "num_tokens": prefix.num_tokens,
            "bits": self.bits,
            "group": self.group,
            "sink": s,
            "seed": self.seed,
        }
        return LayeredKV(self.spec, meta, layers)

    @staticmethod
    def decode(meta, t, dtype):
        bits, group, seed = meta["bits"], meta["group"], meta["seed"]
        k = rotatekv_dequantize(t["k"], t["k_scale"], t["k_mn"], bits, group, seed)
        v = rotatekv_dequantize(t["v"], t["v_scale"], t["v_mn"], bits, group, seed + 1)
        return torch.cat([t["k_sink"].float(), k], 1).to(dtype), torch.cat([t["v_sink"].float(), v], 1).to(dtype)


COMPRESSOR = RotateKVCompressor
