"""split16: a LOSSLESS split of float32 KV in two halves; the compressed copy is the upper half.

Each float32 value is 32 bits, hi:lo (16 + 16). The compressed copy holds hi: the sign, the exponent and
the top 7 mantissa bits, i.e. bfloat16 by truncation (relative error below 2**-7), which drafts nearly as
well as the full KV. Its complement (`halves` gives both) holds lo, and `join(hi, lo)` is the float32 KV bit for
bit. A reader that drafts on the compressed copy first then needs only the complement to have the full
KV, so the compressed copy adds NO bytes on the link: the vLLM connector's pre-draft path
(integration/vllm/connector/split_load.py) streams hi (half the bytes), drafts on it, then streams lo and joins
layer by layer.

    b  = bits(x) (int32)                x  = float(b)
    hi = b >> 16            (int16)     what the drafts attend: float(hi << 16)
    lo = sign-extended low 16 bits      b  = (hi << 16) | (lo & 0xFFFF)

Only float32 KV splits so: a bfloat16 cache's hi IS its KV (the complement would be zeros), so the
connector refuses split16 on a KV cache that is not float32.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass

import torch

from .base import Compressor, LayeredKV, PrefixKV

Tensor = torch.Tensor
COMPLEMENT = "+lo"  # the complement's spec: the compressed copy's spec + this
_LO, _HI = (0, 1) if sys.byteorder == "little" else (1, 0)  # the 16-bit words of a float32 in memory


def split(x: Tensor) -> tuple[Tensor, Tensor]:
    """float32 x -> (hi, lo) int16 halves of its bits: the two 16-bit words of each value in memory, no
    arithmetic (hi = b >> 16 and lo = the sign-extended low 16 bits, as the table above)."""
    if x.dtype != torch.float32:
        raise ValueError(f"split16 splits float32 KV, got {x.dtype}")
    words = x.contiguous().view(torch.int16).unflatten(-1, (-1, 2))
    return words[..., _HI].contiguous(), words[..., _LO].contiguous()


def join(hi: Tensor, lo: Tensor | None) -> Tensor:
    """The float32 values of (hi, lo); lo None: the upper half alone (bfloat16 truncation)."""
    halves = (torch.zeros_like(hi) if lo is None else lo, hi)[:: 1 if _LO == 0 else -1]
    return torch.stack(halves, dim=-1).view(torch.float32).squeeze(-1)


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
        if not isinstance(complement, LayeredKV) or complement.spec != self.spec + COMPLEMENT:
            raise ValueError(f"not a {self.spec} complement: {getattr(complement, 'spec', complement)!r}")
        self.check_complement(compressed, complement.meta, complement.num_layers, hi_digest)
        return [self.join_layer(compressed, i, lo) for i, lo in enumerate(complement.layers)]

    def check_complement(self, compressed: LayeredKV, meta, num_layers: int, hi_digest: str | None = None) -> None:
        """ValueError unless a complement of `num_layers` layers with this meta completes exactly `compressed`."""
        if not isinstance(meta, dict) or meta.get("part") != "lo":
            raise ValueError(f"not a {self.spec} complement (meta {meta!r})")
        if meta.get("num_tokens") != compressed.meta.get("num_tokens") or num_layers != compressed.num_layers:
            raise ValueError("the complement covers another prefix (tokens or layers differ)")
        if meta.get("hi") != (hi_digest or digest(compressed.layers)):
            raise ValueError("the complement was split from other KV than this compressed copy (digest differs)")

    @staticmethod
    def join_layer(compressed: LayeredKV, i: int, lo: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """Layer i's float32 (k, v) from the compressed copy's upper halves and the complement's layer `lo`
        (ValueError unless its tensors are int16 of the same shapes); check_complement checks the rest."""
        hi = compressed.layers[i]
        if not isinstance(lo, dict) or sorted(lo) != ["k", "v"]:
            raise ValueError(f"complement layer {i} has tensors {sorted(lo) if isinstance(lo, dict) else lo}")
        for name in ("k", "v"):
            if lo[name].dtype != torch.int16 or lo[name].shape != hi[name].shape:
                raise ValueError(f"complement layer {i} {name!r} is {lo[name].dtype} {tuple(lo[name].shape)}")
        return join(hi["k"], lo["k"]), join(hi["v"], lo["v"])

    @staticmethod
    def decode(meta, t, dtype):
        if meta.get("part") == "lo":
            raise ValueError("a split16 complement alone is not attendable (join it with its compressed copy)")
        return join(t["k"], None).to(dtype), join(t["v"], None).to(dtype)


COMPRESSOR = Split16Compressor
