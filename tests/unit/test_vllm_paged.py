"""vLLM's paged KV buffers as per-token K/V: both layouts against an explicit index formula."""

from __future__ import annotations

import pytest
import torch

from vericache_connector.integration.vllm.connector.paged_layout import (
    gather_tokens,
    kv_views,
    layer_index,
    scatter_tokens,
)

BLOCKS, H, BS, D = 7, 3, 16, 8


def expected(buf: torch.Tensor, block: int, h: int, t: int, d: int, transposed: bool) -> tuple[float, float]:
    """K[t, d] and V[t, d] of (block, head), straight from the flat memory of one block-head."""
    flat = buf[block, h].reshape(-1)
    k = flat[d * BS + t] if transposed else flat[t * 2 * D + d]
    v = flat[BS * D + t * D + d] if transposed else flat[t * 2 * D + D + d]
    return float(k), float(v)


@pytest.mark.parametrize("transposed", [True, False], ids=["cpu-vec", "cuda-flash"])
def test_views_match_the_layout(transposed):
    buf = torch.randn(BLOCKS, H, BS, 2 * D)
    k, v = kv_views(buf, H, D, keys_transposed=transposed)
    assert k.shape == v.shape == (BLOCKS, H, BS, D)
    for block, h, t, d in [(0, 0, 0, 0), (3, 2, 5, 7), (6, 1, 15, 3)]:
        assert (float(k[block, h, t, d]), float(v[block, h, t, d])) == expected(buf, block, h, t, d, transposed)


@pytest.mark.parametrize("transposed", [True, False], ids=["cpu-vec", "cuda-flash"])
def test_scatter_then_gather_roundtrips_into_the_right_blocks(transposed):
    buf = torch.zeros(BLOCKS, H, BS, 2 * D)
    k, v = kv_views(buf, H, D, keys_transposed=transposed)
    ids = torch.tensor([5, 1, 3])
    keys, values = torch.randn(H, 3 * BS, D), torch.randn(H, 3 * BS, D)
    scatter_tokens(k, ids, keys)
    scatter_tokens(v, ids, values)
    torch.testing.assert_close(gather_tokens(k, ids, 40), keys[:, :40], rtol=0, atol=0)
    torch.testing.assert_close(gather_tokens(v, ids, 48), values, rtol=0, atol=0)
    assert expected(buf, 1, 2, 4, 6, transposed) == (float(keys[2, BS + 4, 6]), float(values[2, BS + 4, 6]))
    assert buf[[0, 2, 4, 6]].abs().sum() == 0  # other blocks untouched


def test_bad_sizes_name_the_values():
    with pytest.raises(ValueError, match=r"\(7, 3, 16, 10\)"):
        kv_views(torch.zeros(BLOCKS, H, BS, 10), H, D)
    k, _ = kv_views(torch.zeros(BLOCKS, H, BS, 2 * D), H, D)
    with pytest.raises(ValueError, match="20 tokens"):
        scatter_tokens(k, torch.tensor([0, 1]), torch.zeros(H, 20, D))
    with pytest.raises(ValueError, match="33 tokens"):
        gather_tokens(k, torch.tensor([0, 1]), 33)
    assert layer_index("model.layers.12.self_attn.attn", 0) == 12 and layer_index("attn", 4) == 4
