"""TOVA (Oren et al. 2024): keep the positions the last prompt token attends to most (its attention
averaged over the query heads of each KV group); the last token itself is always kept."""

from __future__ import annotations

from dataclasses import dataclass

from .dropping import TokenDropCompressor, group_query_scores


@dataclass
class TOVACompressor(TokenDropCompressor):
    name = "tova"

    @property
    def needs_queries(self) -> bool:
        return True

    def scores(self, prefix, layer, keep):
        if prefix.obs_queries is None:
            raise ValueError("tova needs the prefill's observation queries (PrefixKV.obs_queries)")
        score = group_query_scores(prefix.obs_queries[layer][:, -1:], prefix.keys[layer])
        score[:, -1] = float("inf")
        return score


COMPRESSOR = TOVACompressor
