"""StreamingLLM (Xiao et al. 2023): keep the first `sinks` tokens (attention sinks) and the most recent
window; the window is whatever budget the ratio leaves after the sinks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .dropping import TokenDropCompressor


@dataclass
class StreamingLLMCompressor(TokenDropCompressor):
    name = "streamingllm"
    sinks: int = 4

    def __post_init__(self):
        super().__post_init__()
        if self.sinks < 0:
            raise ValueError(f"streamingllm: sinks must be >= 0, got {self.sinks}")

    def scores(self, prefix, layer, keep):
        hk, t = prefix.keys[layer].shape[:2]
        pos = torch.arange(t, dtype=torch.float32, device=prefix.keys[layer].device)
        score = pos.clone()  # recent tokens score highest ...
        score[: min(self.sinks, keep)] = float(t)  # ... and the sinks above all of them
        return score.expand(hk, t)


COMPRESSOR = StreamingLLMCompressor
