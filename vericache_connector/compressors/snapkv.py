"""SnapKV (Li et al. 2024): the last `window` prompt tokens "observe" the prefix; positions that get the
most attention from them (summed over the window and the query heads of a KV group, then smoothed by
a 1D max/avg pooling of width `kernel`) are kept, and the window itself is always kept."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F

from .dropping import TokenDropCompressor, group_query_scores


@dataclass
class SnapKVCompressor(TokenDropCompressor):
    name = "snapkv"
    window: int = 32
    kernel: int = 7

    def __post_init__(self):
        super().__post_init__()
        if self.window < 1 or self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(
                f"snapkv: window must be >= 1 and kernel odd >= 1, got window={self.window}, kernel={self.kernel}"
            )

    @property
    def needs_queries(self) -> bool:
        return True

    def scores(self, prefix, layer, keep):
        if prefix.obs_queries is None:
            raise ValueError("snapkv needs the prefill's observation queries (PrefixKV.obs_queries)")
        keys = prefix.keys[layer]
        obs = prefix.obs_queries[layer]
        w = min(self.window, obs.shape[1], keys.shape[1])
        score = group_query_scores(obs[:, -w:], keys)  # [H_kv, T]
        score = F.avg_pool1d(score[:, None], self.kernel, stride=1, padding=self.kernel // 2, count_include_pad=False)[
            :, 0
        ]
        score[:, -w:] = float("inf")  # the window is always kept
        return score


COMPRESSOR = SnapKVCompressor
