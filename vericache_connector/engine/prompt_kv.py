"""Where a prompt's KV goes at prefill (StepExecutor.prefill, executor.py, hands it each layer as soon as it is done).

  draft side   what drafts attend over, resident:
                 packed     a quantizer's codes and scales in the packed pool (KIVI's float residual in the
                            draft pool): vericache_kernels.paged_packed reads them as they are
                 kept       token dropping (and kvpress presses): the kept positions' keys and values, copied
                            from the prefill's own KV into the draft pool; every (layer, head) holds the same
                            count L, so heads that keep fewer (per-head budgets: KVzip, AdaKV, PyramidKV) are
                            topped up with their most recent dropped positions (drafts only see more exact KV)
                 decoded    any other compressor's copy decoded into the draft pool
  host side    (VeriCache) what a verification reloads: the prompt's whole blocks, or with a COMPLEMENT
               reload only the positions the draft pool does not hold. That needs the kept positions to be
               exact copies (draft pool in the model's dtype): then the draft pool holds, per head, keep_pad
               positions of the stored part (a multiple of the block size, topped up as above), the host tier
               the other stored - keep_pad, and a verification attends [kept blocks, reloaded blocks, resident
               tail] in one pass over one pool (the draft and full pools are one pool then).

The prompt's last partial block (stored = prompt_len // bs * bs) always stays resident in the full pool.
"""

from __future__ import annotations

import math

import torch

from vericache_kernels.kivi import kivi_split

from ..compressors import PrefixKV

Tensor = torch.Tensor


def top_up(mask: Tensor, n: int, limit: int) -> Tensor:
    """Per head, n positions < limit: every kept one (mask [H, >= limit] bool) first, then the most recent
    dropped ones. -> increasing positions [H, n] (long). Needs n >= the kept count below limit."""
    score = mask[:, :limit].float() * (limit + 1) + torch.arange(limit, device=mask.device)
    return score.topk(n, dim=-1).indices.sort(-1).values


def complement(kept: Tensor, limit: int) -> Tensor:
    """Per head the positions < limit not in kept [H, n] -> [H, limit - n] increasing."""
    h = kept.shape[0]
    keep = torch.zeros(h, limit, dtype=torch.bool, device=kept.device)
    keep.scatter_(1, kept, True)
    return (~keep).nonzero()[:, 1].view(h, limit - kept.shape[1])


def masks_of(copy) -> list[Tensor]:
    """Per layer the kept mask [H, T] (bool) of a token-dropping copy (uniform or per-head layout)."""
    t, out = copy.meta["num_tokens"], []
    for layer in copy.layers:
        idx = layer["idx"].long()
        if "counts" in layer:  # heads.py: heads one after another
            counts = layer["counts"].long()
            head = torch.repeat_interleave(torch.arange(counts.numel()), counts)
            m = torch.zeros(counts.numel(), t, dtype=torch.bool)
            m[head, idx] = True
        else:
            m = torch.zeros(idx.shape[0], t, dtype=torch.bool).scatter_(1, idx, True)
        out.append(m)
    return out


class PromptPlacer:
    """One engine's rule for its compressor (see the module docstring). The press masks of a prompt are computed
    once (kvpress runs the checkpoint on its token ids) and kept in `store` (the engine's prefill store) under
    ("press", prompt, spec), so engines and tests serving the same prompts share them."""

    def __init__(self, compressor, packed, complement: bool, block_size: int, inv_freq: Tensor | None, store):
        self.comp, self.packed, self.complement, self.bs = compressor, packed, complement, block_size
        self.inv_freq, self.store = inv_freq, store if store is not None else {}
        self.press = getattr(compressor, "name", None) == "press"
        self.dropping = hasattr(compressor, "keep_count")

    # ---- sizes (admission) ----
    def kept_count(self, prompt_ids: list[int]) -> int:
        """L: positions every (layer, head) of the draft pool holds (token dropping)."""
        t = len(prompt_ids)
        if not self.press:
            return self.comp.keep_count(t)
        return max(int(m.sum(-1).max()) for m in self.masks(prompt_ids))

    def lens(self, prompt_ids: list[int]) -> tuple[int, int]:
        """(entries in the packed pool, prompt entries in the draft pool)."""
        t = len(prompt_ids)
        if self.packed is not None:
            n = kivi_split(t, self.comp.group, self.comp.residual) if self.packed.kind == "kivi" else t
            return n, t - n
        if not self.dropping:
            return 0, t
        if self.complement:
            return 0, self.keep_pad(prompt_ids)
        return 0, self.kept_count(prompt_ids)

    def keep_pad(self, prompt_ids: list[int]) -> int:
        """Complement reload: positions of the stored part the draft pool holds (whole blocks)."""
        stored = len(prompt_ids) // self.bs * self.bs
        return min(stored, math.ceil(self.kept_count(prompt_ids) / self.bs) * self.bs)

    def masks(self, prompt_ids: list[int]) -> list[Tensor]:
        key = ("press", tuple(prompt_ids), self.comp.spec)
        if key not in self.store:
            self.store[key] = [m.cpu() for m in self.comp.kept(list(prompt_ids))]
        return self.store[key]

    # ---- one layer ----
    def draft_side(self, prompt_ids: list[int], layer: int, k: Tensor, v: Tensor, obs: Tensor | None):
        """-> ("packed", the layer's tensors, entries) | ("kv", keys [H, n, D], values) for the draft pool, and the
        dropped positions [H, m] the host tier must hold (complement reload) or None."""
        prefix = PrefixKV([k], [v], None if obs is None else [obs], list(prompt_ids), self.inv_freq)
        if self.packed is not None or not self.dropping:
            comp = self.comp.compress(prefix)
            if self.packed is not None:
                return ("packed", comp.layers[0], comp.meta.get("quantized_tokens", comp.meta["num_tokens"])), None
            return ("kv", *comp.layer_kv(0, k.dtype)), None
        t = k.shape[1]
        mask = self.masks(prompt_ids)[layer].to(k.device) if self.press else None
        if mask is None:
            mask = masks_of(self.comp.compress(prefix))[0].to(k.device)
        if self.complement:
            stored = t // self.bs * self.bs
            kept = top_up(mask, self.keep_pad(prompt_ids), stored)
            dropped = complement(kept, stored)
        else:
            kept, dropped = top_up(mask, self.kept_count(prompt_ids), t), None
        return ("kv", *gather(k, v, kept)), dropped


def gather(k: Tensor, v: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
    """keys, values [H, T, D] at per-head positions idx [H, n] -> [H, n, D] each."""
    g = idx[..., None].expand(-1, -1, k.shape[-1])
    return k.gather(1, g), v.gather(1, g)
