"""What a row holds on the device: the one row-size formula the scheduler admits by and the capacity model
(capacity.for_trace) predicts with.

A row on full KV holds its prompt and emitted tokens in full-pool blocks. A VeriCache row holds its compressed
prompt (a quantizer's codes in packed blocks, the float part in the draft pool), its emitted tokens' exact KV and
one round's drafts in the draft pool, and in the full pool the prompt's last partial block with the emitted tokens
(the prompt's whole blocks are in the host tier); a complement reload shares the draft pool's blocks with the full
pool. Besides its blocks a row needs at times one layer of its prompt's KV (its prefill) and, for its
verifications, a staging ring: `ring` layers of the prompt's whole blocks (less the kept ones with a complement
reload).
"""

from __future__ import annotations

import math


class RowSizes:
    def __init__(
        self,
        cfg,
        block_bytes: dict[str, int],
        num_layers: int,
        full_bytes_per_token: int,
        draft_lens,
        complement: bool = False,
    ):
        """block_bytes: bytes of one block of each pool, all layers (the pools' block_bytes); draft_lens(seq) ->
        (packed prompt entries, draft-pool prompt entries) of a VeriCache row."""
        self.cfg, self.block_bytes, self.num_layers = cfg, block_bytes, num_layers
        self.full_bytes_per_token, self.draft_lens, self.complement = full_bytes_per_token, draft_lens, complement

    def resident_blocks(self, seq, full: bool) -> dict[str, int]:
        """Blocks a row holds for its whole life (what its admission must fit), on full KV or VeriCache."""
        bs, new = self.cfg.block_size, seq.request.max_new_tokens
        if full:
            return {"full": math.ceil((seq.prompt_len + new + 1) / bs)}
        packed, dense = self.draft_lens(seq)
        out = {"packed": math.ceil(packed / bs)} if packed else {}
        if self.cfg.policy == "lossy":
            return {**out, "draft": math.ceil((dense + new + 1) / bs)}
        room = new + self.cfg.k_max + 2  # emitted tokens + one round's drafts + the bonus
        tail = seq.prompt_len % bs  # the prompt's last partial block stays resident
        if self.complement:  # kept blocks; drafts and verifications share the tail's blocks (emitted tokens)
            return {"draft": dense // bs, "full": math.ceil((tail + room) / bs)}
        return {**out, "draft": math.ceil((dense + room) / bs), "full": math.ceil((tail + room) / bs)}

    def cost(self, need: dict[str, int]) -> int:
        """Bytes of {pool: blocks}."""
        return sum(self.block_bytes[p] * n for p, n in need.items())

    def block_cost(self, pool: str, n: int, layers: int | None = None) -> int:
        """Bytes of n blocks of `pool`, or of `layers` of their layers (a staging ring): BlockManager's rule."""
        b = self.block_bytes[pool]
        return n * b if layers is None else n * b * layers // self.num_layers

    def resident_bytes(self, seq, full: bool) -> int:
        return self.cost(self.resident_blocks(seq, full))

    def staging_blocks(self, seq) -> int:
        """Blocks a reload fills: the prompt's whole blocks, less the kept ones (complement reload)."""
        kept = self.draft_lens(seq)[1] if self.complement else 0
        return (seq.prompt_len - kept) // self.cfg.block_size

    def staging_bytes(self, seq, ring: int | None = None) -> int:
        """A staging ring of `ring` layers (None: every layer, a row moving to full KV keeps them all)."""
        return self.block_cost("full", self.staging_blocks(seq), ring)

    def prefill_bytes(self, seq, full: bool) -> int:
        """A prefill's transient KV: one layer of the prompt (a full-KV row's prefill writes into its blocks)."""
        return 0 if full else seq.prompt_len * self.full_bytes_per_token // self.num_layers

    def transient_bytes(self, seq, full: bool) -> int:
        """Besides its blocks, what a row needs at times: its prefill's layer, later (VeriCache) a staging ring."""
        if full:
            return 0
        return max(self.prefill_bytes(seq, False), self.staging_bytes(seq, 2) if self.cfg.policy == "vericache" else 0)

    def need(self, seq, full: bool) -> int:
        """What a row must find free to be admitted alone: its blocks and its transient bytes."""
        return self.resident_bytes(seq, full) + self.transient_bytes(seq, full)
