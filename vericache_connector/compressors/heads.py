"""Per-head budgets (AdaKV-style): each KV head of each layer keeps its own number of positions.

Layout of one layer (LayeredKV tensors), heads packed one after another, no padding stored:
  counts [H_kv] int32     kept positions of head h: n_h (sum = N)
  idx    [N]    int32     the kept positions, head 0's n_0 first, increasing within a head
  k, v   [N, D]           their keys (post-RoPE, at their true positions) and values
nbytes is what is stored: N (2 D + 1) elements plus H counts.

Attending is exact only with each head's own length. `head_kv` pads the heads to the longest one
(zeros) and returns the lengths; the draft caches (vericache_connector.draft.headsplit) attend with
them, so the padding is never seen. Padding without a length (duplicating a kept entry, or a zero key)
would change the softmax: a duplicate counts its entry twice, a zero key gets weight exp(0 - max).
`layer_kv` (the generic CompressedKV API) therefore refuses per-head objects instead of guessing.
"""

from __future__ import annotations

import torch

from .base import CompressedKV, LayeredKV

Tensor = torch.Tensor


def pack_heads(keys: Tensor, values: Tensor, keep: Tensor) -> dict[str, Tensor]:
    """keys/values [H, T, D], keep [H, T] bool -> the layer's tensors (positions in increasing order)."""
    h, t, d = keys.shape
    counts = keep.sum(-1).to(torch.int32)
    head, pos = keep.nonzero(as_tuple=True)  # row-major: head by head, positions increasing
    return {
        "k": keys[head, pos].contiguous(),
        "v": values[head, pos].contiguous(),
        "idx": pos.to(torch.int32).contiguous(),
        "counts": counts.contiguous(),
    }


def uniform_layer(keys: Tensor, values: Tensor, keep: Tensor) -> dict[str, Tensor]:
    """Same count n in every head -> the token-dropping layout k/v [H, n, D], idx [H, n] (dropping.py)."""
    h, t, d = keys.shape
    n = int(keep[0].sum())
    idx = keep.nonzero(as_tuple=True)[1].view(h, n)
    gather = idx[..., None].expand(-1, -1, d)
    return {
        "k": keys.gather(1, gather).contiguous(),
        "v": values.gather(1, gather).contiguous(),
        "idx": idx.to(torch.int32).contiguous(),
    }


def unpack_heads(t: dict[str, Tensor], dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """-> keys, values [H, L, D] (L = max n_h; entries past n_h are zeros) and lengths [H] int64."""
    counts = t["counts"].long()
    h, (n, d) = counts.numel(), t["k"].shape
    width = int(counts.max()) if h else 0
    head = torch.repeat_interleave(torch.arange(h, device=counts.device), counts)
    start = torch.cumsum(counts, 0) - counts
    slot = torch.arange(n, device=counts.device) - start[head]  # position within the head
    k = t["k"].new_zeros(h, width, d, dtype=dtype)
    v = t["v"].new_zeros(h, width, d, dtype=dtype)
    k[head, slot] = t["k"].to(dtype)
    v[head, slot] = t["v"].to(dtype)
    return k, v, counts


def is_per_head(c: CompressedKV) -> bool:
    """True for a compressed copy whose layers keep a different count per head (the layout above)."""
    return isinstance(c, LayeredKV) and c.meta.get("layout") == "heads"


def head_kv(c: CompressedKV, layer: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """Keys, values [H, L, D] and lengths [H] of one layer of any compressed copy: padded per-head
    objects as unpack_heads, every other one through layer_kv with L in every head."""
    if is_per_head(c):
        return unpack_heads(c.layers[layer], dtype)
    k, v = c.layer_kv(layer, dtype)
    return k, v, torch.full((k.shape[0],), k.shape[1], dtype=torch.long, device=k.device)


def check_layer(i: int, layer: dict, layout: str, keep: int, num_tokens: int, heads: int, head_dim: int) -> None:
    """ValueError unless layer i is a well-formed token-dropping layer of a `num_tokens` prefix:
    "uniform" (dropping.py: `keep` positions in every head) or "heads" (pack_heads: per-head counts)."""
    names = ["counts", "idx", "k", "v"] if layout == "heads" else ["idx", "k", "v"]
    if not isinstance(layer, dict) or sorted(layer) != names:
        got = sorted(layer) if isinstance(layer, dict) else type(layer).__name__
        raise ValueError(f"compressed copy layer {i} has tensors {got}, expected {names}")
    k, v, idx = layer["k"], layer["v"], layer["idx"]
    if not all(isinstance(x, torch.Tensor) for x in layer.values()):
        raise ValueError(f"compressed copy layer {i} holds a non-tensor")
    if not k.is_floating_point() or v.dtype != k.dtype or idx.dtype != torch.int32:
        raise ValueError(f"compressed copy layer {i} dtypes k={k.dtype}, v={v.dtype}, idx={idx.dtype}")
    if layout == "heads":
        counts = layer["counts"]
        if counts.dtype != torch.int32 or tuple(counts.shape) != (heads,) or bool((counts < 0).any()):
            raise ValueError(
                f"compressed copy layer {i} counts {tuple(counts.shape)} {counts.dtype} are not {heads} >= 0"
            )
        n = int(counts.sum())
        shapes = {"k": (n, head_dim), "v": (n, head_dim), "idx": (n,)}
    else:
        shapes = {"k": (heads, keep, head_dim), "v": (heads, keep, head_dim), "idx": (heads, keep)}
    for name, shape in shapes.items():
        if tuple(layer[name].shape) != shape:
            raise ValueError(
                f"compressed copy layer {i} {name!r} has shape {tuple(layer[name].shape)}, expected {shape}"
            )
    if not (bool(torch.isfinite(k.float()).all()) and bool(torch.isfinite(v.float()).all())):
        raise ValueError(f"compressed copy layer {i} holds NaN or inf")
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= num_tokens):
        raise ValueError(f"compressed copy layer {i}: kept positions outside [0, {num_tokens})")
    segments = torch.split(idx, layer["counts"].tolist()) if layout == "heads" else list(idx)
    for seg in segments:
        if seg.numel() > 1 and not bool((seg[1:] > seg[:-1]).all()):
            raise ValueError(f"compressed copy layer {i}: kept positions are not increasing")
