"""Rows of a VeriCache engine going on on their full KV (the scheduler's; Scheduler.moves).

At a verification a row's prompt has just been reloaded into staging blocks, every layer of them: keeping those
blocks (charging the layers beyond the staging ring) gives the row its whole full KV, and its compressed KV and
host copy can go; from then on it decodes one exact token a step. That happens at the trace's tail (nothing
waiting, the budget has no other use: switch_to_full, lowest acceptance first), and, where VeriCache loses to full
KV (the guard sets Scheduler.fallback), at any time a row's full KV fits (move_rows): lowest acceptance first, one
row at a time, VeriCache rows of a higher acceptance paused to make room where that makes it fit (their compressed
KV freed; they resume on full KV by a reload of their prompt and a verification of no drafts).
"""

from __future__ import annotations

from .sequence import Phase, Sequence


class FullKVMoves:
    def __init__(self, sched):
        self.sched = sched  # the Scheduler whose rows, budget and plans these are (written `s` below)

    def switch_to_full(self, seq: Sequence) -> bool:
        """At a verification (its prompt just reloaded into staging blocks, every layer of them): should the row
        keep that full KV and decode on it from now on? A row move_rows picked does (its staging holds every
        layer already). Otherwise at the trace's tail only (nothing waiting, paused or still to arrive, so the
        budget has no other use), where the rest of its whole full KV fits the budget, and the row with the lowest
        acceptance first (it gains the most: fewer tokens per verification)."""
        s = self.sched
        if not seq.staging or s.complement:
            return False
        extra = s.sizes.block_cost("full", len(seq.staging)) - s.sizes.block_cost(
            "full", len(seq.staging), seq.staging_ring
        )
        if seq.moving:
            return s.blocks.fits(extra)
        if not s.cfg.tail_full or s.waiting or s.arrivals or s.prefilling or s.paused:
            return False
        if not s.blocks.fits(extra):
            return False
        others = [q.alpha for q in s.running if q is not seq and not q.full_kv and q.alpha is not None]
        return seq.alpha is None or not others or seq.alpha <= min(others)

    def keep_full(self, seq: Sequence, now: float) -> None:
        """The row's staging blocks become its prompt's resident full KV; its compressed KV and host copy go."""
        s = self.sched
        s.blocks.grow("full", len(seq.staging), seq.staging_ring)
        for pool in ("draft", "packed"):
            if pool in seq.blocks:
                s.blocks.free(pool, seq.blocks.pop(pool))
        seq.blocks["full"] = seq.staging + seq.blocks["full"]
        seq.staging, seq.reload, seq.host, seq.full_kv, seq.switched_s = [], None, None, True, now
        seq.switched_by, seq.moving = "guard" if seq.moving else "tail", False
        s.plans.pop(seq.request_id, None)
        s.rings.release(seq.request_id)
        seq.phase = Phase.DECODING

    def move_rows(self) -> None:
        """`fallback` while VeriCache rows run (the guard measured that they lose): one row at a time goes on on
        its full KV, lowest acceptance first, once that fits: a running row verifies what it drafted at once, over
        a reload that stages every layer, and keeps them; a paused row reloads its prompt and does the same with no
        drafts. Where a row's full KV does not fit, VeriCache rows of a higher acceptance are paused to make room
        (their compressed KV freed; their host copy and emitted tokens' exact KV kept) if that makes it fit.
        Not with a complement reload (the kept positions live only in the draft pool)."""
        s = self.sched
        if s.complement or any(q.moving for q in s.running):
            return
        rows = sorted([q for q in s.running if not q.full_kv] + s.paused, key=self._alpha)
        for seq in rows:
            if seq.reload is not None or not s.fits_full(seq):
                continue  # (a row mid-reload is looked at again next step)
            need = s.sizes.staging_bytes(seq) + s.rings.peak_memory(s.step)
            pause = []
            for other in reversed(rows):  # highest acceptance first
                if s.blocks.fits(need - sum(self._compressed_bytes(o) for o in pause)):
                    break
                if other is not seq and other in s.running and other.reload is None and s.fits_full(other):
                    pause.append(other)  # (only a row that can resume on full KV)
            if not s.blocks.fits(need - sum(self._compressed_bytes(o) for o in pause)):
                continue
            for other in pause:
                self.pause(other)
            self.start_move(seq)
            return

    def _alpha(self, seq: Sequence) -> float:
        return self.sched.cfg.alpha_prior if seq.alpha is None else seq.alpha

    def _compressed_bytes(self, seq: Sequence) -> int:
        return self.sched.sizes.cost({p: len(seq.blocks[p]) for p in ("draft", "packed") if p in seq.blocks})

    def pause(self, seq: Sequence) -> None:
        """A VeriCache row leaves the batch: its compressed KV and drafts go; it resumes on full KV (move_rows)."""
        s = self.sched
        for pool in ("draft", "packed"):
            if pool in seq.blocks:
                s.blocks.free(pool, seq.blocks.pop(pool))
        seq.drafts, seq.draft_probs, seq.proposal, seq.draft_len, seq.packed_len = [], [], [], 0, 0
        seq.verify_step = None
        s.plans.pop(seq.request_id, None)
        s.rings.release(seq.request_id)
        s.running.remove(seq)
        s.paused.append(seq)
        seq.phase = Phase.PAUSED

    def start_move(self, seq: Sequence) -> None:
        """Reload the row's prompt into staging blocks charged for every layer, and verify at once."""
        s = self.sched
        s.plans.pop(seq.request_id, None)
        s.rings.release(seq.request_id)
        if seq in s.paused:
            s.paused.remove(seq)
            s.running.append(seq)
        seq.moving, seq.horizon = True, len(seq.drafts)
        if s.start_reload(seq, ring=s.num_layers):
            seq.verify_step = s.step
