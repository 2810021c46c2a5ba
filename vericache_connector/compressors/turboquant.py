"""TurboQuant-style vector quantization (Zandieh et al. 2025): rotate, then scalar-quantize.

Each key/value row x is stored as its norm (float16) and the b-bit codes of R x/|x|, where R is a fixed
random orthogonal matrix: after the rotation every coordinate is ~N(0, 1/D), so one Lloyd-Max
codebook for that Gaussian serves all rows and channels (no per-group scales). Keys and values get
their own bit widths ("k4v3" = 4-bit keys, 3-bit values); codes are bit-packed (kernels.turboquant).
"""

from __future__ import annotations

from dataclasses import dataclass

from vericache_kernels.turboquant import turbo_dequantize, turbo_quantize

from .base import Compressor, LayeredKV, PrefixKV


@dataclass
class TurboQuantCompressor(Compressor):
    name = "turboquant"
    key_bits: int = 4
    value_bits: int = 3
    seed: int = 0

    def __post_init__(self):
        for label, b in (("key_bits", self.key_bits), ("value_bits", self.value_bits)):
            if not isinstance(b, int) or not 1 <= b <= 8:
                raise ValueError(f"turboquant: {label} must be an int in 1..8, got {b!r}")

    def compress(self, prefix: PrefixKV) -> LayeredKV:
        layers = []
        for k, v in zip(prefix.keys, prefix.values):
            kp, kn = turbo_quantize(k, self.key_bits, self.seed)
            vp, vn = turbo_quantize(v, self.value_bits, self.seed + 1)
            layers.append({"k": kp, "k_norm": kn, "v": vp, "v_norm": vn})
        meta = {
            "compressor": self.name,
            "num_tokens": prefix.num_tokens,
            "key_bits": self.key_bits,
            "value_bits": self.value_bits,
            "seed": self.seed,
        }
        return LayeredKV(self.spec, meta, layers)

    @staticmethod
    def decode(meta, t, dtype):
        return (
            turbo_dequantize(t["k"], t["k_norm"], meta["key_bits"], meta["seed"], dtype),
            turbo_dequantize(t["v"], t["v_norm"], meta["value_bits"], meta["seed"] + 1, dtype),
        )


COMPRESSOR = TurboQuantCompressor
