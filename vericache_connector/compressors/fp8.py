"""fp8 (e4m3): per-token scaled cast. scale = max|x| / 448 (the largest finite e4m3 value), stored as
float16; x ~= fp8(x / scale) * scale. One byte per element plus 2 bytes per (head, token) vector."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .scaled import ScaledCompressor, per_token_scale

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


@dataclass
class FP8Compressor(ScaledCompressor):
    name = "fp8"

    @staticmethod
    def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale, div = per_token_scale(x, FP8_MAX)
        return (x.float() / div).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


COMPRESSOR = FP8Compressor
