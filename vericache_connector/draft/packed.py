"""Draft layout "packed": the stored tensors themselves, read by the kernels' packed decode ops.

KIVI / TurboQuant bit-packed codes are read by vericache_kernels.kivi_decode_attention /
turbo_decode_attention; other compressors are kept as dense K/V in the model's dtype and read by
vericache_kernels.prefix_attention. A separate exact tail [B, H_kv, capacity, D] per layer holds the
emitted tokens (KIVI's full-precision residual window opens it). Triton on CUDA; on the CPU the torch
references, exact but slower than the dense layouts (bit unpacking in torch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import vericache_kernels as K

from ..compressors import CompressedKV
from ..model.kv_cache import RowCache
from .config import DraftConfig
from .dense import check_layers, decode_rows

Tensor = torch.Tensor


@dataclass
class _Prefix:
    """One layer of one compressed prefix in the form its op reads ([1, H_kv, n, ...] tensors)."""

    kind: str  # dense | kivi | turbo
    n: int  # prefix tokens (the tail holds the rest)
    t: dict
    meta: dict

    def attend(self, q: Tensor, kt: Tensor, vt: Tensor, backend: str) -> Tensor:
        """q [1, Hq, Lq, D] over this prefix plus the tail kt/vt [1, H_kv, Lt, D], one op call."""
        t, m = self.t, self.meta
        if self.n == 0:
            return K.verify_attention(q, kt, vt, backend=backend)
        if self.kind == "kivi":
            return K.kivi_decode_attention(
                q,
                t["k"],
                t["k_scale"],
                t["k_mn"],
                t["v"],
                t["v_scale"],
                t["v_mn"],
                bits=m["bits"],
                k_group=m["group"],
                v_group=m["value_group"],
                k_tail=kt,
                v_tail=vt,
                backend=backend,
            )
        if self.kind == "turbo":  # values were coded with seed + 1 (compressors/turboquant.py)
            return K.turbo_decode_attention(
                q,
                t["k"],
                t["k_norm"],
                t["v"],
                t["v_norm"],
                bits=m["key_bits"],
                v_bits=m["value_bits"],
                seed=m["seed"],
                v_seed=m["seed"] + 1,
                k_tail=kt,
                v_tail=vt,
                backend=backend,
            )
        return K.prefix_attention(q, t["k"], t["v"], kt, vt, backend=backend)


def _packable(c: CompressedKV, cfg: DraftConfig) -> bool:
    """Keep this object's codes packed? Explicit "packed": always; "auto": when Triton takes its bits."""
    meta = getattr(c, "meta", {})
    bits = {"kivi": ("bits",), "turboquant": ("key_bits", "value_bits")}.get(meta.get("compressor"))
    if bits is None:
        return False
    if cfg.layout == "packed":
        return True
    from vericache_kernels._attn_triton import triton_supports  # "auto" resolved to packed: triton imports

    return triton_supports(c.layers[0]["k"].shape[-1] * 8 // meta[bits[0]], *(meta[b] for b in bits))


def _packed_layers(c: CompressedKV, cfg: DraftConfig, model) -> list[tuple[_Prefix, Tensor | None, Tensor | None]]:
    """Per layer: (_Prefix, residual keys [H_kv, r, D] or None, residual values) of one object."""
    out, dev = [], model.device
    if not _packable(c, cfg):
        for k, v in decode_rows(model, [c], model.dtype)[0]:
            t = {"k": k.to(dev)[None].contiguous(), "v": v.to(dev)[None].contiguous()}
            out.append((_Prefix("dense", k.shape[1], t, {}), None, None))
        return out
    kind = "kivi" if c.meta["compressor"] == "kivi" else "turbo"
    for t in c.layers:
        codes = {name: x.to(dev)[None] for name, x in t.items() if name not in ("k_tail", "v_tail")}
        res = [t[n].to(device=dev, dtype=model.dtype) if n in t else None for n in ("k_tail", "v_tail")]
        out.append((_Prefix(kind, codes["k"].shape[2], codes, c.meta), *res))
    return out


class PackedDraftCache(RowCache):
    """Per row a compressed prefix (shared by rows built from one object) and a batched exact tail
    [B, H_kv, capacity, D] per layer in the model's dtype. lengths[b] counts both."""

    def __init__(self, model, compressed: list[CompressedKV], extra: int, cfg: DraftConfig):
        if extra < 1:
            raise ValueError(f"extra (tail room for new tokens) must be >= 1, got {extra}")
        built: dict[int, list] = {}
        for row, c in enumerate(compressed):
            check_layers(model, c, row)
            if id(c) not in built:
                built[id(c)] = _packed_layers(c, cfg, model)
        self.rows = [built[id(c)] for c in compressed]  # rows[b][layer] = (_Prefix, res_k, res_v)
        self.backend, mc, dev = cfg.backend, model.cfg, model.device
        res = [0 if layers[0][1] is None else layers[0][1].shape[1] for layers in self.rows]
        self.capacity = max(res) + extra
        shape = (len(compressed), mc.num_kv_heads, self.capacity, mc.head_dim)
        self.keys = [torch.zeros(shape, dtype=model.dtype, device=dev) for _ in range(mc.num_layers)]
        self.values = [torch.zeros(shape, dtype=model.dtype, device=dev) for _ in range(mc.num_layers)]
        self.prefix_lengths = torch.tensor([layers[0][0].n for layers in self.rows], device=dev)
        for row, layers in enumerate(self.rows):
            for layer, (prefix, rk, rv) in enumerate(layers):
                if rk is not None:
                    self.store_entries(layer, row, prefix.n, rk, rv)
        self.lengths = self.prefix_lengths + torch.tensor(res, device=dev)

    @property
    def nbytes(self) -> int:
        """Bytes a step reads: each row's stored prefix, plus the valid tail entries."""
        prefix = sum(x.nbytes for layers in self.rows for p, _, _ in layers for x in p.t.values())
        per_token = sum(k[0, :, 0].nbytes + v[0, :, 0].nbytes for k, v in zip(self.keys, self.values))
        return prefix + int((self.lengths - self.prefix_lengths).sum()) * per_token

    def store_entries(self, layer: int, row: int, start: int, k: Tensor, v: Tensor) -> None:
        """start counts prefix + tail entries (as lengths); only tail entries can be written."""
        d, n = start - int(self.prefix_lengths[row]), k.shape[1]
        if d < 0 or d + n > self.capacity:
            raise ValueError(
                f"draft cache overflow: row {row} entries {start}..+{n} are outside the tail "
                f"(prefix {int(self.prefix_lengths[row])}, tail capacity {self.capacity})"
            )
        self.keys[layer][row, :, d : d + n] = k
        self.values[layer][row, :, d : d + n] = v

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Write k/v, then attend q [B, Hq, Lq, D] over each row's prefix and tail (the Lq new entries
        are the tail's last; causal among them), one op call per row. -> [B, Hq, Lq, D]."""
        for b, start in enumerate(self.lengths.tolist()):
            self.store_entries(layer, b, start, k[b], v[b])
        tail = (self.lengths - self.prefix_lengths + q.shape[2]).tolist()
        return torch.cat(
            [
                self.rows[b][layer][0].attend(
                    q[b : b + 1], self.keys[layer][b : b + 1, :, :n], self.values[layer][b : b + 1, :, :n], self.backend
                )
                for b, n in enumerate(tail)
            ]
        )
