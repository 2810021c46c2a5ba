"""int8: symmetric per-token quantization of keys and values.

For each (head, token) vector x: scale = max|x| / 127, code = round(x / scale) in [-127, 127];
stored as int8 codes plus one float16 scale per vector (D + 2 bytes per 2*D-byte fp16 vector).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .scaled import ScaledCompressor, per_token_scale


@dataclass
class Int8Compressor(ScaledCompressor):
    name = "int8"

    @staticmethod
    def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale, div = per_token_scale(x, 127.0)
        return (x.float() / div).round().clamp(-127, 127).to(torch.int8), scale


COMPRESSOR = Int8Compressor
