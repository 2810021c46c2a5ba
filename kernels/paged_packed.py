"""Attention over a PACKED paged prefix (quantized codes + scales in fixed-size blocks) and a float paged tail,
without decoding the prefix to floats in memory: the serving engine's quantized draft pool.

Formats (PackedFormat; the codes and scales are exactly the compressors' own, compressors/kivi.py, int8.py,
fp8.py, re-laid into blocks of bs tokens so that a block is self-contained):
  kivi  keys per channel over groups of k_group tokens, packed ALONG TOKENS (kernels/bitpack.py order):
            k        uint8   [blocks, H, D, bs * k_bits / 8]
            k_scale, k_mn  float16 [blocks, H, D, bs / k_group]
        values per token over runs of v_group channels, packed along channels:
            v        uint8   [blocks, H, bs, D * v_bits / 8]
            v_scale, v_mn  float16 [blocks, H, bs, D / v_group]
        x = code * scale + mn
  int8  k int8 [blocks, H, D, bs] (keys transposed, as vLLM's CPU layout), v int8 [blocks, H, bs, D],
        k_scale / v_scale float16 [blocks, H, bs] (one per token): x = code * scale
  fp8   the same with float8 e4m3 codes (stored as uint8)
Per layer, a block of bs tokens costs PackedFormat.block_bytes (what the device budget counts).

The tail is a float paged cache in vericache_kernels.paged's layout (keys [blocks, H, D, bs], values
[blocks, H, bs, D]): KIVI's full-precision residual, then the emitted tokens' exact KV and the drafts.
Row b attends over its prefix_lens[b] packed entries (all visible) and its tail_lens[b] tail entries, its
queries (query_start_loc) being the last of the tail, causal bottom-right among themselves.

  packed_paged_attention_ref   torch reference: per row, dequantize to float32 and attend
  packed_paged_attention       dispatch: Triton on CUDA (_paged_packed_triton.py), the fused C++ kernel on the
                               CPU (_packed_cpu.py; one pass, each block dequantized in an L1 buffer), else a
                               vectorized torch path (dequantizes every row's blocks each call: the fallback)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._dispatch import BACKENDS, triton_available
from .bitpack import pack_bits_ref, unpack_bits_ref
from .paged import FLOATS, paged_gather

Tensor = torch.Tensor
FP8 = torch.float8_e4m3fn
KINDS = ("kivi", "int8", "fp8")


@dataclass(frozen=True)
class PackedFormat:
    kind: str
    k_bits: int = 8
    v_bits: int = 8
    k_group: int = 1
    v_group: int = 1

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"packed format kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "kivi":
            for name in ("k_bits", "v_bits"):
                if getattr(self, name) not in (2, 4, 8):
                    raise ValueError(f"packed kivi {name} must be 2, 4 or 8, got {getattr(self, name)!r}")
            if self.k_group < 1 or self.v_group < 1:
                raise ValueError(f"packed kivi groups must be >= 1, got {self.k_group}, {self.v_group}")

    @classmethod
    def from_meta(cls, meta: dict) -> "PackedFormat | None":
        """The format of a compressor's output (LayeredKV.meta), or None when it has no packed pool form."""
        name = meta.get("compressor")
        if name == "kivi" and meta.get("bits") in (2, 4, 8):
            return cls("kivi", meta["bits"], meta["bits"], meta["group"], meta["value_group"])
        if name in ("int8", "fp8"):
            return cls(name)
        return None

    def check(self, num_kv_heads: int, head_dim: int, block_size: int) -> None:
        """ValueError unless a block of this shape holds whole bytes and whole groups."""
        if self.kind != "kivi":
            return
        for bits, n, what in ((self.k_bits, block_size, "block_size"), (self.v_bits, head_dim, "head_dim")):
            if (n * bits) % 8:
                raise ValueError(f"packed kivi: {what} {n} does not pack into bytes at {bits} bits")
        if block_size % self.k_group or self.k_group % (8 // self.k_bits):
            raise ValueError(f"packed kivi: key group {self.k_group} must divide block_size {block_size}")
        if head_dim % self.v_group or self.v_group % (8 // self.v_bits):
            raise ValueError(f"packed kivi: value group {self.v_group} must divide head_dim {head_dim}")

    def shapes(
        self, num_kv_heads: int, head_dim: int, block_size: int
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """{tensor name: (shape of one block, dtype)}."""
        h, d, bs = num_kv_heads, head_dim, block_size
        f16 = torch.float16
        if self.kind == "kivi":
            return {
                "k": ((h, d, bs * self.k_bits // 8), torch.uint8),
                "k_scale": ((h, d, bs // self.k_group), f16),
                "k_mn": ((h, d, bs // self.k_group), f16),
                "v": ((h, bs, d * self.v_bits // 8), torch.uint8),
                "v_scale": ((h, bs, d // self.v_group), f16),
                "v_mn": ((h, bs, d // self.v_group), f16),
            }
        code = torch.int8 if self.kind == "int8" else torch.uint8
        return {"k": ((h, d, bs), code), "k_scale": ((h, bs), f16), "v": ((h, bs, d), code), "v_scale": ((h, bs), f16)}

    def block_bytes(self, num_kv_heads: int, head_dim: int, block_size: int) -> int:
        """Bytes of one block of one layer (codes and scales)."""
        shapes = self.shapes(num_kv_heads, head_dim, block_size)
        return sum(math.prod(s) * dt.itemsize for s, dt in shapes.values())


def new_packed_cache(
    fmt: PackedFormat, blocks: int, num_kv_heads: int, head_dim: int, block_size: int, device="cpu"
) -> dict[str, Tensor]:
    """One layer's zeroed packed blocks."""
    fmt.check(num_kv_heads, head_dim, block_size)
    return {
        name: torch.zeros((blocks, *shape), dtype=dt, device=device)
        for name, (shape, dt) in fmt.shapes(num_kv_heads, head_dim, block_size).items()
    }


def _blocks(x: Tensor, n_blocks: int, per_block: int, dim: int = 1) -> Tensor:
    """Pad x along `dim` (tokens) to n_blocks * per_block and split it: [H, n, ...] -> [H, nb, per_block, ...]."""
    pad = n_blocks * per_block - x.shape[dim]
    if pad:
        shape = list(x.shape)
        shape[dim] = pad
        x = torch.cat([x, torch.zeros(shape, dtype=x.dtype, device=x.device)], dim)
    return x.reshape(*x.shape[:dim], n_blocks, per_block, *x.shape[dim + 1 :])


def to_blocks(fmt: PackedFormat, tensors: dict[str, Tensor], n: int, block_size: int) -> dict[str, Tensor]:
    """A compressor's layer tensors for n quantized tokens ([H, n, ...], as compressors/kivi.py / scaled.py store
    them) -> whole blocks {name: [nb, ...block shape]} of this format (the last block zero-padded)."""
    bs, nb = block_size, math.ceil(n / block_size)
    if fmt.kind == "kivi":
        d = tensors["v"].shape[-1] * 8 // fmt.v_bits
        kc = unpack_bits_ref(tensors["k"], fmt.k_bits, d)  # [H, n, D]
        kc = _blocks(kc, nb, bs).permute(1, 0, 3, 2)  # [nb, H, D, bs]
        per_group = bs // fmt.k_group
        return {
            "k": pack_bits_ref(kc.contiguous(), fmt.k_bits),
            "k_scale": _blocks(tensors["k_scale"], nb, per_group).permute(1, 0, 3, 2).contiguous(),
            "k_mn": _blocks(tensors["k_mn"], nb, per_group).permute(1, 0, 3, 2).contiguous(),
            "v": _blocks(tensors["v"], nb, bs).transpose(0, 1).contiguous(),
            "v_scale": _blocks(tensors["v_scale"], nb, bs).transpose(0, 1).contiguous(),
            "v_mn": _blocks(tensors["v_mn"], nb, bs).transpose(0, 1).contiguous(),
        }

    def codes(x):
        return x.view(torch.uint8) if x.dtype == FP8 else x

    return {
        "k": _blocks(codes(tensors["k"]), nb, bs).permute(1, 0, 3, 2).contiguous(),
        "k_scale": _blocks(tensors["k_scale"][..., 0], nb, bs).transpose(0, 1).contiguous(),
        "v": _blocks(codes(tensors["v"]), nb, bs).transpose(0, 1).contiguous(),
        "v_scale": _blocks(tensors["v_scale"][..., 0], nb, bs).transpose(0, 1).contiguous(),
    }


def packed_write(cache: dict[str, Tensor], block_ids: list[int] | Tensor, blocks: dict[str, Tensor]) -> None:
    """Whole blocks (to_blocks) into the layer's cache at block_ids."""
    first = next(iter(cache.values()))
    ids = torch.as_tensor(block_ids, dtype=torch.long, device=first.device)
    for name, x in blocks.items():
        cache[name].index_copy_(0, ids, x.to(first.device))


def packed_gather(
    fmt: PackedFormat, cache: dict[str, Tensor], block_table: Tensor, row: int, n: int
) -> tuple[Tensor, Tensor]:
    """Row `row`'s first n packed entries dequantized: float32 keys, values [H, n, D]."""
    if n == 0:
        k = cache["k"]  # [blocks, H, D, ...] in every format
        empty = torch.zeros(k.shape[1], 0, k.shape[2], device=k.device)
        return empty, empty.clone()
    ids = block_table[row, : math.ceil(n / cache["v"].shape[2])].long()
    t = {name: x[ids] for name, x in cache.items()}
    nb, h = ids.shape[0], t["k"].shape[1]
    if fmt.kind == "kivi":
        d = t["k"].shape[2]
        bs = t["v"].shape[2]
        kc = unpack_bits_ref(t["k"], fmt.k_bits, bs).float()  # [nb, H, D, bs]
        ks = t["k_scale"].float().repeat_interleave(fmt.k_group, -1)
        km = t["k_mn"].float().repeat_interleave(fmt.k_group, -1)
        k = torch.addcmul(km, kc, ks).permute(1, 0, 3, 2).reshape(h, nb * bs, d)
        vc = unpack_bits_ref(t["v"], fmt.v_bits, d).float()  # [nb, H, bs, D]
        vs = t["v_scale"].float().repeat_interleave(fmt.v_group, -1)
        vm = t["v_mn"].float().repeat_interleave(fmt.v_group, -1)
        v = torch.addcmul(vm, vc, vs).transpose(0, 1).reshape(h, nb * bs, d)
        return k[:, :n], v[:, :n]

    def decode(x):
        return x.view(FP8).float() if fmt.kind == "fp8" else x.float()

    d, bs = t["k"].shape[2], t["k"].shape[3]
    k = (decode(t["k"]) * t["k_scale"].float()[:, :, None, :]).permute(1, 0, 3, 2).reshape(h, nb * bs, d)
    v = (decode(t["v"]) * t["v_scale"].float()[..., None]).transpose(0, 1).reshape(h, nb * bs, d)
    return k[:, :n], v[:, :n]


def _tail_dtype(tail_k: Tensor) -> str:
    for name, dt in FLOATS.items():
        if tail_k.dtype == dt:
            return name
    raise ValueError(f"the tail must be a float paged cache (float16 / bfloat16 / float32), got {tail_k.dtype}")


def packed_paged_attention_ref(
    q: Tensor,
    query_start_loc: Tensor,
    fmt: PackedFormat,
    cache: dict[str, Tensor],
    prefix_lens: Tensor,
    prefix_table: Tensor,
    tail_k: Tensor,
    tail_v: Tensor,
    tail_lens: Tensor,
    tail_table: Tensor,
    sm_scale: float | None = None,
) -> Tensor:
    """Reference: per row, its prefix dequantized to float32 and its tail gathered, softmax(q k^T * scale) v with
    the prefix visible to every query and the tail causal bottom-right. -> [N, Hq, D] in q's dtype."""
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    tdt = _tail_dtype(tail_k)
    out = torch.empty_like(q)
    for b in range(prefix_lens.shape[0]):
        s, e = int(query_start_loc[b]), int(query_start_loc[b + 1])
        np_, nt, lq = int(prefix_lens[b]), int(tail_lens[b]), e - s
        if lq == 0:
            continue
        kp, vp = packed_gather(fmt, cache, prefix_table, b, np_)
        kt, vt = paged_gather(tail_k, tail_v, tail_table, b, nt, tdt)
        k, v = torch.cat([kp, kt], 1), torch.cat([vp, vt], 1)
        group = q.shape[1] // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        qb = q[s:e].float().transpose(0, 1)  # [Hq, lq, D]
        scores = qb @ k.transpose(1, 2) * scale
        j = torch.arange(np_ + nt, device=q.device)[None]
        visible = (j < np_) | (j - np_ <= (nt - lq + torch.arange(lq, device=q.device))[:, None])
        scores = scores.masked_fill(~visible, float("-inf"))
        out[s:e] = (scores.softmax(-1) @ v).transpose(0, 1).to(q.dtype)
    return out


def packed_paged_attention_torch(
    q, query_start_loc, fmt, cache, prefix_lens, prefix_table, tail_k, tail_v, tail_lens, tail_table, sm_scale=None
) -> Tensor:
    """The CPU fallback (no C++ compiler): every row's blocks dequantized in one batched pass, then one padded
    batched attention. Decodes the whole prefix each call (what the fused kernel avoids)."""
    n_rows = prefix_lens.shape[0]
    d, hq = q.shape[-1], q.shape[1]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    tdt = _tail_dtype(tail_k)
    qsl = query_start_loc.tolist()
    lqs = [qsl[b + 1] - qsl[b] for b in range(n_rows)]
    plen, tlen = prefix_lens.tolist(), tail_lens.tolist()
    big = max(plen + [0])
    # prefix: all rows' blocks in one gather + dequantize ([B, H, P, D])
    kp = vp = None
    if big:
        width = math.ceil(big / cache["v"].shape[2])
        table = prefix_table[:, :width].reshape(-1)[None]
        kp, vp = packed_gather(fmt, cache, table, 0, width * n_rows * cache["v"].shape[2])
        h = kp.shape[0]
        kp = kp.reshape(h, n_rows, -1, d).transpose(0, 1)[:, :, :big]
        vp = vp.reshape(h, n_rows, -1, d).transpose(0, 1)[:, :, :big]
    tails = [paged_gather(tail_k, tail_v, tail_table, b, tlen[b], tdt) for b in range(n_rows)]
    tmax, lmax = max(tlen), max(lqs)
    h = tail_k.shape[1]
    kt = torch.zeros(n_rows, h, tmax, d, device=q.device)
    vt = torch.zeros_like(kt)
    for b, (k, v) in enumerate(tails):
        kt[b, :, : tlen[b]], vt[b, :, : tlen[b]] = k, v
    k = kt if kp is None else torch.cat([kp, kt], 2)
    v = vt if vp is None else torch.cat([vp, vt], 2)
    qp = torch.zeros(n_rows, hq, lmax, d, device=q.device)
    for b in range(n_rows):
        qp[b, :, lmax - lqs[b] :] = q[qsl[b] : qsl[b + 1]].float().transpose(0, 1)
    g = hq // h
    scores = (qp.reshape(n_rows, h, g * lmax, d) @ k.transpose(2, 3)) * scale  # [B, H, G*Lq, P + T]
    j = torch.arange(big + tmax, device=q.device)
    i = torch.arange(lmax, device=q.device).repeat(g)  # query slot (right-aligned)
    pl = torch.tensor(plen, device=q.device)[:, None, None]
    tl_ = torch.tensor(tlen, device=q.device)[:, None, None]
    jt = j[None, None] - big
    vis = (j[None, None] < pl) | ((jt >= 0) & (jt < tl_) & (jt <= tl_ - lmax + i[None, :, None]))
    scores = scores.masked_fill(~vis[:, None], float("-inf"))
    o = (scores.softmax(-1).nan_to_num(0.0) @ v).reshape(n_rows, hq, lmax, d)
    out = torch.empty_like(q)
    for b in range(n_rows):
        out[qsl[b] : qsl[b + 1]] = o[b, :, lmax - lqs[b] :].transpose(0, 1).to(q.dtype)
    return out


def uses_fused_cpu(backend: str, q: Tensor) -> bool:
    """True -> packed_paged_attention runs the fused C++ kernel (building it on first use)."""
    import os

    if backend != "auto" or q.device.type != "cpu" or os.environ.get("VERICACHE_KERNELS", "").lower() == "ref":
        return False
    from . import _packed_cpu

    return _packed_cpu.available()


def packed_paged_attention(
    q: Tensor,
    query_start_loc: Tensor,
    fmt: PackedFormat,
    cache: dict[str, Tensor],
    prefix_lens: Tensor,
    prefix_table: Tensor,
    tail_k: Tensor,
    tail_v: Tensor,
    tail_lens: Tensor,
    tail_table: Tensor,
    sm_scale: float | None = None,
    *,
    backend: str = "auto",
) -> Tensor:
    """Dispatch (see the module docstring). q [N, Hq, D]; int32 index tensors; -> [N, Hq, D] in q's dtype.
    backend: auto | ref | triton | torch (the vectorized CPU path) | cpp (the fused CPU kernel)."""
    if backend not in BACKENDS + ("torch", "cpp"):
        raise ValueError(f"backend must be one of {BACKENDS + ('torch', 'cpp')}, got {backend!r}")
    _tail_dtype(tail_k)
    args = (q, query_start_loc, fmt, cache, prefix_lens, prefix_table, tail_k, tail_v, tail_lens, tail_table)
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    if backend == "ref":
        return packed_paged_attention_ref(*args, scale)
    if backend == "triton" or (backend == "auto" and q.is_cuda and triton_available()):
        from ._paged_packed_triton import packed_paged_attention_triton

        return packed_paged_attention_triton(*args, scale)
    if backend == "cpp" or uses_fused_cpu(backend, q):
        from . import _packed_cpu

        if backend == "cpp" and not _packed_cpu.available():
            raise RuntimeError("backend='cpp' requested but the fused CPU kernel did not build")
        qf = q.float().contiguous()
        c = {name: x.contiguous() for name, x in cache.items()}
        out = _packed_cpu.attention(
            qf,
            query_start_loc,
            fmt.kind,
            fmt.k_bits,
            fmt.v_bits,
            fmt.k_group,
            fmt.v_group,
            cache["v"].shape[2],
            c,
            prefix_lens,
            prefix_table,
            tail_k.contiguous(),
            tail_v.contiguous(),
            tail_lens,
            tail_table,
            scale,
        )
        return out.to(q.dtype)
    return packed_paged_attention_torch(*args, scale)


def random_packed_case(
    fmt: PackedFormat,
    prefix_lens: list[int],
    tail_lens: list[int],
    q_lens: list[int],
    num_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    block_size: int = 128,
    tail_dtype: torch.dtype = torch.float16,
    q_dtype: torch.dtype = torch.float32,
    device="cpu",
    seed: int = 0,
) -> tuple:
    """Random arguments of packed_paged_attention (rows of these prefix / tail / query lengths, blocks
    scattered over the pools in shuffled order, every code and scale valid): for the kernel checks, and for the
    capacity model's kernel timings (vericache_connector/engine/calibrate.py): package code, so it ships here,
    not in tests/support."""
    from .paged import new_paged_cache

    g = torch.Generator(device="cpu").manual_seed(seed)
    bs, h, d = block_size, num_kv_heads, head_dim
    nb = [math.ceil(n / bs) for n in prefix_lens]
    nt = [math.ceil(n / bs) for n in tail_lens]
    total, ttotal = sum(nb) + 1, sum(nt) + 1
    cache = {}
    for name, (shape, dt) in fmt.shapes(h, d, bs).items():
        if dt == torch.float16:  # scales > 0, mins around 0
            x = (
                torch.rand(total, *shape, generator=g) * 0.2 + 0.01
                if "scale" in name
                else torch.randn(total, *shape, generator=g)
            )
        elif fmt.kind == "fp8":  # finite e4m3 codes (0x7f / 0xff are NaN)
            x = torch.randint(0, 256, (total, *shape), generator=g)
            x = torch.where((x & 0x7F) == 0x7F, x - 1, x)
        else:
            lo = -128 if dt == torch.int8 else 0
            x = torch.randint(lo, lo + 256, (total, *shape), generator=g)
        cache[name] = x.to(dt).to(device)
    tk, tv = new_paged_cache(ttotal, h, d, bs, str(tail_dtype).removeprefix("torch."), "cpu")
    tk.copy_(torch.randn(tk.shape, generator=g))
    tv.copy_(torch.randn(tv.shape, generator=g))
    perm, tperm = torch.randperm(total, generator=g).tolist(), torch.randperm(ttotal, generator=g).tolist()
    ptab = torch.zeros(len(prefix_lens), max(nb + [1]), dtype=torch.int32)
    ttab = torch.zeros(len(tail_lens), max(nt + [1]), dtype=torch.int32)
    for b in range(len(prefix_lens)):
        ptab[b, : nb[b]] = torch.tensor([perm.pop() for _ in range(nb[b])], dtype=torch.int32)
        ttab[b, : nt[b]] = torch.tensor([tperm.pop() for _ in range(nt[b])], dtype=torch.int32)
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    q = torch.randn(int(qsl[-1]), num_heads, d, generator=g).to(q_dtype)
    i32 = torch.int32
    return (
        q.to(device),
        qsl.to(device),
        fmt,
        cache,
        torch.tensor(prefix_lens, dtype=i32, device=device),
        ptab.to(device),
        tk.to(device),
        tv.to(device),
        torch.tensor(tail_lens, dtype=i32, device=device),
        ttab.to(device),
    )
