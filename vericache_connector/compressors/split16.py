"""split16: a LOSSLESS split of float32 KV in two halves; the compressed copy is the upper half.

Each float32 value is 32 bits, hi:lo (16 + 16). The compressed copy holds hi: the sign, the exponent and
the top 7 mantissa bits, i.e. bfloat16 by truncation (relative error below 2**-7), which drafts nearly as
well as the full KV. Its complement (`halves` gives both) holds lo, and `join(hi, lo)` is the float32 KV bit for
bit. A reader that drafts on the compressed copy first then needs only the complement to have the full
KV, so the compressed copy adds NO bytes on the link: the vLLM connector's pre-draft path
(integration/vllm/worker.py) fetches hi (half the bytes), drafts on it, then fetches lo and joins.

    b  = bits(x) (int32)                x  = float(b)
    hi = b >> 16            (int16)     what the drafts attend: float(hi << 16)
    lo = sign-extended low 16 bits      b  = (hi << 16) | (lo & 0xFFFF)

Only float32 KV splits so: a bfloat16 cache's hi IS its KV (the complement would be zeros), so the
connector refuses split16 on a KV cache that is not float32.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from .base import Compressor, LayeredKV, PrefixKV

Tensor = torch.Tensor
COMPLEMENT = "+lo"  # the complement's spec: the compressed copy's spec + this


def split(x: Tensor) -> tuple[Tensor, Tensor]:
    """float32 x -> (hi, lo) int16 halves of its bits (int64 arithmetic: no int32 shift overflow)."""
    if x.dtype != torch.float32:
        raise ValueError(f"split16 splits float32 KV, got {x.dtype}")
    b = x.contiguous().view(torch.int32).to(torch.int64)
    lo = b & 0xFFFF
    return (b >> 16).to(torch.int16), (lo - ((lo & 0x8000) << 1)).to(torch.int16)


def join(hi: Tensor, lo: Tensor | None) -> Tensor:
    """The float32 values of (hi, lo); lo None: the upper half alone (bfloat16 truncation)."""
    b = hi.to(torch.int64) << 16
    if lo is not None:
        b = b | (lo.to(torch.int64) & 0xFFFF)
    return b.to(torch.int32).view(torch.float32)


def digest(layers: list[dict[str, Tensor]]) -> str:
    """BLAKE2b of the upper halves: the complement names the compressed copy it completes."""
    h = hashlib.blake2b(digest_size=16)
    for layer in layers:
        for name in ("k", "v"):
            h.update(layer[name].contiguous().numpy().tobytes())
    return h.hexdigest()


@dataclass
class Split16Compressor(Compressor):
    name = "split16"

    def compress(self, prefix: PrefixKV) -> LayeredKV:
        layers = [{"k": split(k.float())[0], "v": split(v.float())[0]} for k, v in zip(prefix.keys, prefix.values)]
        return LayeredKV(self.spec, {"compressor": self.name, "num_tokens": prefix.num_tokens}, layers)

    def halves(self, prefix: PrefixKV) -> tuple[LayeredKV, LayeredKV]:
        """(the compressed copy, its complement) of `prefix`, from one split of each tensor; the complement
        names the upper halves it completes by digest."""
        hi, lo = [], []
        for k, v in zip(prefix.keys, prefix.values):
            (kh, kl), (vh, vl) = split(k.float()), split(v.float())
            hi.append({"k": kh, "v": vh})
            lo.append({"k": kl, "v": vl})
        n = prefix.num_tokens
        compressed = LayeredKV(self.spec, {"compressor": self.name, "num_tokens": n}, hi)
        meta = {"compressor": self.name, "part": "lo", "num_tokens": n, "hi": digest(hi)}
        return compressed, LayeredKV(self.spec + COMPLEMENT, meta, lo)

    def full_layers(
        self, compressed: LayeredKV, complement: LayeredKV, hi_digest: str | None = None
    ) -> list[tuple[Tensor, Tensor]]:
        """[(k, v)] float32 per layer, bit for bit the KV both halves were split from. ValueError unless the
        complement is this compressor's, of the same shapes, and completes exactly this compressed copy
        (hi_digest: `digest(compressed.layers)` if the caller computed it already, e.g. during a fetch)."""
        meta = complement.meta if isinstance(complement, LayeredKV) else None
        if not isinstance(meta, dict) or complement.spec != self.spec + COMPLEMENT or meta.get("part") != "lo":
            raise ValueError(f"not a {self.spec} complement: {getattr(complement, 'spec', complement)!r}")
        if (
            meta.get("num_tokens") != compressed.meta.get("num_tokens")
            or complement.num_layers != compressed.num_layers
        ):
            raise ValueError("the complement covers another prefix (tokens or layers differ)")
        for i, (hi, lo) in enumerate(zip(compressed.layers, complement.layers)):
            if not isinstance(lo, dict) or sorted(lo) != ["k", "v"]:
                raise ValueError(f"complement layer {i} has tensors {sorted(lo) if isinstance(lo, dict) else lo}")
            for name in ("k", "v"):
                if lo[name].dtype != torch.int16 or lo[name].shape != hi[name].shape:
                    raise ValueError(f"complement layer {i} {name!r} is {lo[name].dtype} {tuple(lo[name].shape)}")
        if meta.get("hi") != (hi_digest or digest(compressed.layers)):
            raise ValueError("the complement was split from other KV than this compressed copy (digest differs)")
        return [
            (join(hi["k"], lo["k"]), join(hi["v"], lo["v"])) for hi, lo in zip(compressed.layers, complement.layers)
        ]

    @staticmethod
    def decode(meta, t, dtype):
        if meta.get("part") == "lo":
            raise ValueError("a split16 complement alone is not attendable (join it with its compressed copy)")
        return join(t["k"], None).to(dtype), join(t["v"], None).to(dtype)


COMPRESSOR = Split16Compressor
