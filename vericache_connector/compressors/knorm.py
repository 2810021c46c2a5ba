"""Key-norm (query-free; Devoto et al. 2024, kvpress KnormPress): keys with a LOW L2 norm draw more
attention, so the positions with the smallest key norm per KV head are kept."""

from __future__ import annotations

from dataclasses import dataclass

from .dropping import TokenDropCompressor


@dataclass
class KnormCompressor(TokenDropCompressor):
    name = "knorm"

    def scores(self, prefix, layer, keep):
        return -prefix.keys[layer].float().norm(dim=-1)


COMPRESSOR = KnormCompressor
