"""Which pools a ServingEngine holds its KV in, their layout, and how many blocks each is made with.

full     the model's dtype: full-KV rows' prompts and tokens, VeriCache rows' resident tail and emitted tokens,
         and the staging blocks their reloads fill
draft    cfg.draft_dtype: the compressed prompt decoded (or a quantizer's float part: KIVI's residual), emitted
         tokens' exact KV, a round's drafts. With a complement reload (token dropping whose kept positions are
         exact copies) the draft pool IS the full pool, and a verification attends kept + reloaded in one pass.
packed   a quantizer's codes and scales as it made them (KIVI 2/4/8-bit, int8, fp8: kernels/paged_packed.py),
         attended without decoding (cfg.draft_layout "auto" / "packed")
"""

from __future__ import annotations

import warnings

import torch

import vericache_kernels.paged_packed as PP

from .block_manager import KVPool, PackedPool

RELOADS_STAGED = 2  # staging areas the full pool is made with (the budget decides how many are used; it grows)
MODEL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class PoolLayout:
    def __init__(self, cfg, model, compressor):
        self.cfg, self.mc, self.device, self.compressor = cfg, model.cfg, model.device, compressor
        self.full_dtype = MODEL_DTYPES[model.dtype]
        self.packed = self._packed_format()
        self.complement = self._complement()
        self.block_bytes = self._block_bytes()

    def _packed_format(self) -> PP.PackedFormat | None:
        """The packed pool's format for this compressor (draft_layout "auto" / "packed"), or None (decoded)."""
        c, layout = self.compressor, self.cfg.draft_layout
        if c is None or layout == "decoded":
            return None
        meta = {"compressor": c.name, **{k: getattr(c, k, None) for k in ("bits", "group", "value_group")}}
        fmt = PP.PackedFormat.from_meta(meta)
        if fmt is None:
            if layout == "packed":
                raise ValueError(
                    f"draft_layout 'packed' holds KIVI (2/4/8 bits), int8 or fp8 codes; compressor "
                    f"{self.cfg.compressor!r} has no packed form (use 'auto' or 'decoded')"
                )
            return None
        try:
            fmt.check(self.mc.num_kv_heads, self.mc.head_dim, self.cfg.block_size)
        except ValueError as e:
            if layout == "packed":
                raise
            warnings.warn(f"{self.cfg.compressor}: {e}; its prompt is decoded into the draft pool", stacklevel=4)
            return None
        return fmt

    def _complement(self) -> bool:
        """Reload only what the draft pool lacks (token dropping, the kept positions held in the model's dtype)?"""
        c, r = self.compressor, self.cfg.reload
        ok = (
            self.cfg.policy == "vericache"
            and self.packed is None
            and hasattr(c, "keep_count")
            and self.cfg.draft_dtype == self.full_dtype
        )
        if r == "complement" and not ok:
            raise ValueError(
                f"reload 'complement' needs a token-dropping compressor (got {self.cfg.compressor!r}) whose kept "
                f"positions are exact copies: draft_dtype must be the model's {self.full_dtype!r} "
                f"(got {self.cfg.draft_dtype!r}), policy 'vericache'"
            )
        return ok and r != "full"

    def _block_bytes(self) -> dict[str, int]:
        """Bytes of one block, every layer, of each pool (what KVPool / PackedPool.block_bytes will be)."""
        mc, bs = self.mc, self.cfg.block_size
        out = {
            name: mc.kv_bytes_per_token(getattr(torch, dtype).itemsize) * bs
            for name, dtype in (("full", self.full_dtype), ("draft", self.cfg.draft_dtype))
        }
        if self.complement:
            out["draft"] = out["full"]
        if self.packed is not None:
            out["packed"] = mc.num_layers * self.packed.block_bytes(mc.num_kv_heads, mc.head_dim, bs)
        return out

    def make(self, seqs: list, sizes) -> dict[str, KVPool]:
        """The pools' physical blocks for the requests known now: in each pool what their rows could hold at once
        (on full KV or VeriCache, whichever holds more there), up to what the budget pays for, plus, for
        VeriCache, whole staging areas for a few reloads (a staging ring holds a prompt's blocks in every layer of
        the pool's layout, while the budget counts only the ring's layers). A pool that turns out short grows
        (BlockManager.allocate)."""
        mc, cfg, bs = self.mc, self.cfg, self.cfg.block_size
        shape = (mc.num_layers, mc.num_kv_heads, mc.head_dim, bs)
        vc = cfg.policy == "vericache"
        wants: dict[str, int] = {}
        for s in seqs:
            for row in [sizes.resident_blocks(s, cfg.policy == "full")] + (
                [sizes.resident_blocks(s, True)] if vc else []
            ):
                for name, n in row.items():
                    wants[name] = wants.get(name, 0) + n
        if self.complement:  # the kept positions are full-pool blocks too
            wants["full"] = wants.get("full", 0) + wants.pop("draft", 0)
        dtypes = {"full": self.full_dtype, "draft": cfg.draft_dtype}
        names = {"full": ["full"], "lossy": ["draft"], "vericache": ["draft", "full"]}[cfg.policy]
        pools = {}
        for name in names + (["packed"] if self.packed is not None else []):
            cap = wants.get(name, 0)
            if cfg.budget_bytes is not None:
                cap = min(cap, cfg.budget_bytes // self.block_bytes[name])
            blocks = cap + len(seqs) + 2
            if vc and name == "full":
                blocks += RELOADS_STAGED * max((s.prompt_len // bs for s in seqs), default=0)
            if name == "packed":
                pools[name] = PackedPool(name, *shape[:3], bs, self.packed, blocks, self.device)
            elif not (name == "draft" and self.complement):
                pools[name] = KVPool(name, *shape, dtypes[name], blocks, self.device)
        if self.complement:
            pools["draft"] = pools["full"]
        return pools
