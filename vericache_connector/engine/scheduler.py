"""The serving scheduler: admission under a device KV budget and what each step runs, for three policies.

  full       full KV resident (the prompt and every emitted token), one token per row per step; a request
             is admitted when its whole KV fits the budget (what a server does today).
  lossy      only the compressed KV resident, one token per row per step on it (fast, inexact; reference).
  vericache  the compressed KV resident in the draft pool; the prompt's full KV in the host tier; each row
             drafts on the compressed KV and, every `horizon` drafts, verifies them in one forward over
             its full KV, whose prompt part streams over the host link into a ring of staging layers for that
             verification (rounds.py: planned on the reservation rings of planner.py, so verifications are
             staggered across rows and the link carries one reload at a time). Emitted tokens keep their exact
             KV resident.

A VeriCache engine also serves rows on full KV: rows admitted while `fallback` is set (the capacity model or the
guard says VeriCache loses here, ServingEngine._decide), rows moved there in flight (moves.py: lowest acceptance
first, each once its whole full KV fits, VeriCache rows paused to make room where that alone lets it fit), and rows
switched at the trace's tail. Rows join as soon as their blocks (and, for VeriCache, their reloads)
fit, and leave when done (continuous batching). A step is either one prompt's prefill or one packed forward over every running
row (model_runner.py). A prefill holds one layer of the prompt's full KV at a time (the rest goes to the
host tier or the compressor as soon as each layer is done); a full-KV prefill writes into its own blocks.
"""

from __future__ import annotations

import bisect
import collections

import torch

from ..draft.ngram import NgramIndex
from .block_manager import BlockManager
from .config import ServingConfig
from .host_tier import Link
from .model_runner import Batch, Prefilled, Segment
from .moves import FullKVMoves
from .planner import AcceptanceEstimate, ReservationRings
from .rounds import VeriCacheRounds
from .sequence import Phase, Sequence
from .sizes import RowSizes


class Scheduler(VeriCacheRounds):
    """Owns every sequence's bookkeeping: arrivals, admission, the reload plans (and starting the reloads on
    the link: VeriCacheRounds, rounds.py), what each step runs (schedule) and what its results change
    (postprocess)."""

    def __init__(
        self,
        cfg: ServingConfig,
        blocks: BlockManager,
        sizes: RowSizes,
        max_context: int,
        eos: tuple[int, ...] = (),
        link: Link | None = None,
    ):
        self.cfg, self.blocks, self.sizes, self.link = cfg, blocks, sizes, link
        self.complement, self.max_context, self.eos = sizes.complement, max_context, eos
        self.num_layers = sizes.num_layers
        self.arrivals: list[Sequence] = []  # not arrived yet, by arrival time
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.prefilling: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.paused: list[Sequence] = []  # VeriCache rows whose compressed KV was freed: they resume on full KV
        self.fallback = False  # admit rows on full KV (where theirs fits the budget): VeriCache loses here
        self.peak_rows = 0  # most rows admitted and not finished at once
        self.step = 0
        self.step_s = 0.1  # EMA of a decode step's compute seconds (reload planning)
        self.draft_s: float | None = None  # EMAs of steps without / with a verifying row (the horizon's costs)
        self.verify_s: float | None = None
        self.rings = ReservationRings(cfg.lookahead)
        self.estimates: dict[str, AcceptanceEstimate] = {}
        self.plans: dict[str, tuple[int, int, int]] = {}  # request id -> (reload start step, verify step, ring)
        self.moves = FullKVMoves(self)  # moves.py: rows going on on their full KV

    @property
    def finished(self) -> bool:
        return not (self.arrivals or self.waiting or self.prefilling or self.running or self.paused)

    def add(self, seq: Sequence) -> None:
        """A request to serve, from its arrival time on (Sequence.arrival_s; ServingEngine.check checked it)."""
        bisect.insort(self.arrivals, seq, key=lambda s: s.arrival_s)

    @property
    def vericache(self) -> bool:
        return self.cfg.policy == "vericache"

    def fits_full(self, seq: Sequence) -> bool:
        """Could the row ever be served on full KV (its whole full KV within the budget)?"""
        return self.blocks.budget is None or self.sizes.need(seq, True) <= self.blocks.budget

    # ---- admission ----
    def admit(self) -> None:
        """Admit waiting requests in arrival order while their blocks, their prefill, the staging already
        planned and (VeriCache) their reloads fit; on full KV under the full policy or while `fallback` is set.
        Not while paused rows wait to resume (they came first)."""
        while self.waiting and not self.paused and len(self.running) + len(self.prefilling) < self.cfg.max_rows:
            seq = self.waiting[0]
            full = self.cfg.policy == "full" or (self.vericache and self.fallback and self.fits_full(seq))
            need = self.sizes.resident_blocks(seq, full)
            extra = self.sizes.cost(need) + self.sizes.transient_bytes(seq, full)
            if self.vericache:  # and still room for any row's smallest staging ring, beyond what is planned
                rings = [self.staging_bytes(s, ring=2) for s in self.running if not s.full_kv]
                extra = self.sizes.cost(need) + max([self.sizes.transient_bytes(seq, full)] + rings)
                extra += self.rings.peak_memory(self.step)
                if not full and not self._link_admits(seq):
                    return
            if not self.blocks.fits(extra):
                return
            self.waiting.popleft()
            seq.blocks = {pool: self.blocks.allocate(pool, n) for pool, n in need.items()}
            seq.phase, seq.full_kv = Phase.PREFILL, full
            self.prefilling.append(seq)

    def _link_admits(self, seq: Sequence) -> bool:
        """Would the link keep up with one more row's reloads at the longest horizon (one reload of every
        row per k_max steps)?"""
        if self.cfg.link_bytes_per_s is None or not (self.running or self.prefilling):
            return True
        rows = [s for s in self.running + list(self.prefilling) if not s.full_kv] + [seq]
        return sum(self.reload_seconds(s) for s in rows) <= self.cfg.k_max * self.step_s

    # ---- what a packed step runs ----
    def segments(self) -> list[Segment]:
        """This step's rows (see the module docstring)."""
        out, streaming = [], []
        in_flight = sorted(
            (s.reload for s in self.running if s.reload is not None and not s.reload.done), key=lambda r: r.submitted_s
        )
        head = in_flight[:1]
        for seq in self.running:
            pos = seq.prompt_len + len(seq.output) - 1  # pending's true position
            if seq.full_kv:
                out.append(Segment(seq, "full", [seq.pending], [pos], seq.blocks["full"], seq.full_len, "decode"))
            elif self.cfg.policy == "lossy":
                seg = Segment(seq, "draft", [seq.pending], [pos], seq.blocks["draft"], seq.draft_len, "decode")
                out.append(self._with_packed(seg))
            elif self._verify_ok(seq, head, streaming):
                seq.phase = Phase.VERIFYING
                toks = [seq.pending] + seq.drafts
                view = seq.staging + seq.blocks["full"]
                if self.complement:  # [kept, reloaded, resident tail]: every prompt position once
                    view = seq.blocks["draft"] + view
                out.append(
                    Segment(
                        seq, "full", toks, list(range(pos, pos + len(toks))), view, seq.full_len, "verify", seq.reload
                    )
                )
            elif "draft" in seq.blocks and len(seq.drafts) < self.draft_cap(seq):
                last = seq.drafts[-1] if seq.drafts else seq.pending
                toks = [last] + seq.proposal[: max(0, self.draft_cap(seq) - len(seq.drafts) - 1)]
                view = seq.blocks["draft"] + (seq.blocks["full"] if self.complement else [])
                at = pos + len(seq.drafts)
                seg = Segment(seq, "draft", toks, list(range(at, at + len(toks))), view, seq.draft_len, "draft")
                out.append(self._with_packed(seg))
        return out

    @staticmethod
    def _with_packed(seg: Segment) -> Segment:
        """A draft-pool segment also attends over the row's packed prompt, if it has one."""
        if "packed" in seg.seq.blocks:
            seg.packed, seg.packed_len = seg.seq.blocks["packed"], seg.seq.packed_len
        return seg

    def _verify_ok(self, seq: Sequence, head: list, streaming: list) -> bool:
        r = seq.reload
        if r is None:
            return False
        due = (seq.verify_step is not None and self.step >= seq.verify_step) or (
            r.prefetched and len(seq.drafts) >= min(seq.horizon, self.draft_cap(seq))
        )
        if not due:
            return False
        if r.done:
            return True
        if head and head[0] is r and not streaming:  # the reload on the link now: at most one streams
            streaming.append(r)
            return True
        return False

    # ---- one step: schedule (here) -> run (ServingEngine) -> postprocess (here) ----
    def schedule(self, now: float) -> Batch:
        """What the next step runs: the oldest admitted prompt's prefill, else one packed forward over every
        running row (after planning rounds and putting the reloads that are due on the link)."""
        while self.arrivals and self.arrivals[0].arrival_s <= now:
            self.waiting.append(self.arrivals.pop(0))
        if self.fallback and self.link is not None:
            self.moves.move_rows()
        self.admit()
        self.peak_rows = max(self.peak_rows, len(self.running) + len(self.prefilling))
        if self.prefilling:
            seq = self.prefilling.popleft()
            seq.admitted_s = now
            self.blocks.hold(self.sizes.prefill_bytes(seq, seq.full_kv))  # its layer of full KV, until postprocess
            return Batch(prefill=seq)
        if self.link is not None:
            for seq in self.running:
                if seq.verify_step is None and seq.phase in (Phase.DRAFTING, Phase.RELOADING):
                    self.plan(seq)
            for seq in self.due_reloads():
                self.start_reload(seq)
        return Batch(segments=self.segments())

    def postprocess(self, batch: Batch, result, now: float, compute_s: float = 0.0) -> list[tuple[Sequence, int]]:
        """Apply a step's results (Prefilled, or {id(seq): Sampled} for a packed step): token bookkeeping,
        emissions, the next round. Returns (sequence, tokens emitted) pairs."""
        if batch.prefill is not None:
            return [self._prefilled(batch.prefill, result, now)]
        self.step_s = 0.8 * self.step_s + 0.2 * compute_s if self.step > 0 else compute_s
        if self.vericache:
            name = "verify_s" if any(seg.kind == "verify" for seg in batch.segments) else "draft_s"
            old = getattr(self, name)
            setattr(self, name, compute_s if old is None else 0.8 * old + 0.2 * compute_s)
        self.step += 1
        self.rings.advance(self.step)
        emitted = []
        for seg in batch.segments:
            seq, r = seg.seq, result[id(seg.seq)]
            if seg.kind == "draft":  # the n-gram proposals fed this step, then the model's next draft
                for t in seg.tokens[1:]:
                    seq.drafts.append(t)
                    if r.q is not None:  # a proposal's law is a point mass on it
                        seq.draft_probs.append(torch.zeros_like(r.q).index_fill_(0, torch.tensor(t), 1.0))
                seq.ngram_drafted += len(seg.tokens) - 1
                seq.drafts.append(r.token)
                if r.q is not None:
                    seq.draft_probs.append(r.q)
                seq.draft_len += len(seg.tokens)
                self.propose(seq)
            elif seg.kind == "decode":
                if seq.full_kv:
                    seq.full_len += 1
                else:
                    seq.draft_len += 1
                seq.pending = r.token
                emitted.append((seq, self.emit(seq, [r.token], now)))
            else:  # verify: pending + the accepted drafts joined both caches (exact KV); the token is pending
                n, k = r.accepted, len(seq.drafts)
                if k:  # (a paused row resuming on full KV verifies no drafts: a decode step, not a round)
                    self.estimates.setdefault(seq.request_id, AcceptanceEstimate(self.cfg.alpha_prior)).update(n, k)
                    seq.accepted.append(n)
                    seq.drafted.append(k)
                seq.full_len, seq.draft_len = seq.full_len + n + 1, seq.draft_len - k + n + 1
                new = seq.drafts[:n] + [r.token]
                seq.drafts, seq.draft_probs, seq.pending = [], [], r.token
                switch = self.moves.switch_to_full(seq)
                if not switch:
                    self.release_staging(seq)
                emitted.append((seq, self.emit(seq, new, now)))  # finishing frees the staging either way
                if seq.phase == Phase.FINISHED:
                    pass
                elif switch:
                    self.moves.keep_full(seq, now)
                else:
                    seq.phase = Phase.DRAFTING
                    self.start_round(seq)
                    self.propose(seq)
        return emitted

    def propose(self, seq: Sequence) -> None:
        """The n-gram proposals the row's next draft step feeds (ServingConfig.ngram; none when off)."""
        if seq.ngram is not None:
            room = min(self.cfg.ngram, self.draft_cap(seq) - len(seq.drafts) - 1)
            seq.proposal = seq.ngram.propose(seq.drafts, room)

    def _prefilled(self, seq: Sequence, r: Prefilled, now: float) -> tuple[Sequence, int]:
        self.blocks.release(self.sizes.prefill_bytes(seq, seq.full_kv))
        seq.full_len, seq.draft_len, seq.packed_len, seq.pending = seq.prompt_len, r.draft_len, r.packed_len, r.first
        if r.host is not None:
            seq.host, seq.stored_prompt = r.host, r.host.stored
        self.step += 1
        n = self.emit(seq, [r.first], now)
        if seq.phase != Phase.FINISHED:
            self.running.append(seq)
            drafting = self.vericache and not seq.full_kv
            seq.phase = Phase.DRAFTING if drafting else Phase.DECODING
            if drafting:
                if self.cfg.ngram:
                    seq.ngram = NgramIndex(
                        seq.request.prompt_ids + seq.output, self.cfg.ngram_match, self.cfg.ngram_match + 3
                    )
                self.start_round(seq)
                self.propose(seq)
        return seq, n

    def verify_failed(self, batch: Batch) -> None:
        """A reload of this step failed (the engine recomputed its KV): the verifying rows retry next step."""
        for seg in batch.segments:
            if seg.kind == "verify":
                seg.seq.phase = Phase.RELOADING

    def emit(self, seq: Sequence, tokens: list[int], now: float) -> int:
        before = len(seq.output)
        if seq.emit(tokens, self.eos, self.cfg.stop_at_eos, now):
            self.finish(seq)
        elif seq.ngram is not None:
            seq.ngram.extend(seq.output[before:])
        return len(seq.output) - before

    def finish(self, seq: Sequence) -> None:
        for pool, ids in seq.blocks.items():
            self.blocks.free(pool, ids)
        seq.blocks, seq.host = {}, None
        self.release_staging(seq)
        if seq in self.running:
            self.running.remove(seq)
        self.estimates.pop(seq.request_id, None)
