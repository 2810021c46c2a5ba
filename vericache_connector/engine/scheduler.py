"""The serving scheduler: admission under a device KV budget and what each step runs, for three policies.

  full       full KV resident (the prompt and every emitted token), one token per row per step; a request
             is admitted when its whole KV fits the budget (what a server does today).
  lossy      only the compressed KV resident, one token per row per step on it (fast, inexact; reference).
  vericache  the compressed KV resident in the draft pool; the prompt's full KV in the host tier; each row
             drafts on the compressed KV and, every `horizon` drafts, verifies them in one forward over
             its full KV, whose prompt part streams over the host link into a ring of staging layers for that
             verification (planned on the reservation rings of planner.py, so verifications are staggered
             across rows and the link carries one reload at a time). Emitted tokens keep their exact KV
             resident.

Rows join as soon as their blocks (and, for VeriCache, their reloads) fit, and leave when done
(continuous batching). A step is either one prompt's prefill or one packed forward over every running
row (model_runner.py). A prefill holds one layer of the prompt's full KV at a time (the rest goes to the
host tier or the compressor as soon as each layer is done); a full-KV prefill writes into its own blocks.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass

from .block_manager import BlockManager
from .model_runner import Segment
from .planner import AcceptanceEstimate, ReservationRings, choose_horizon, reload_steps
from .sequence import Phase, Sequence

POLICIES = ("full", "lossy", "vericache")


@dataclass
class ServingConfig:
    policy: str = "vericache"
    budget_bytes: int | None = None  # device KV budget (None: unlimited)
    compressor: str = "snapkv-4x"  # the compressed KV (lossy, vericache)
    draft_dtype: str = "float16"  # the draft pool's storage
    link_bytes_per_s: float | None = None  # host link (None: as fast as memory copies go)
    block_size: int = 128
    max_rows: int = 64
    horizon: int | None = None  # a fixed draft horizon; None: chosen per row and round
    k_min: int = 4
    k_max: int = 64
    alpha_prior: float = 0.8  # per-draft acceptance before a row has verified (measured curve)
    verify_cost: float = 1.0  # a verification's cost in draft steps (horizon choice)
    staging_layers: int | None = None  # the staging ring's layers; None: as many as keep the forward from waiting
    lookahead: int = 512  # W: steps the reservation rings plan ahead
    temperature: float = 0.0
    stop_at_eos: bool = False
    obs_window: int = 32
    backend: str = "auto"  # kernels backend (auto | ref)

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if not 1 <= self.k_min <= self.k_max:
            raise ValueError(f"need 1 <= k_min <= k_max, got k_min={self.k_min}, k_max={self.k_max}")
        if self.horizon is not None and not 1 <= self.horizon <= self.k_max:
            raise ValueError(f"horizon must be in [1, k_max={self.k_max}], got {self.horizon}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.alpha_prior < 1:
            raise ValueError(f"alpha_prior must be in (0, 1), got {self.alpha_prior}")
        if self.max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {self.max_rows}")
        if self.staging_layers is not None and self.staging_layers < 1:
            raise ValueError(f"staging_layers must be >= 1 or None, got {self.staging_layers}")
        if self.link_bytes_per_s is not None and not self.link_bytes_per_s > 0:
            raise ValueError(f"link_bytes_per_s must be > 0 or None, got {self.link_bytes_per_s}")


class Scheduler:
    def __init__(self, cfg: ServingConfig, blocks: BlockManager, full_bytes_per_token: int, max_context: int):
        self.cfg, self.blocks = cfg, blocks
        self.full_bytes_per_token, self.max_context = full_bytes_per_token, max_context
        self.num_layers = next(iter(blocks.pools.values())).num_layers
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.prefilling: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.step = 0
        self.step_s = 0.1  # EMA of a decode step's compute seconds (reload planning)
        self.rings = ReservationRings(cfg.lookahead)
        self.estimates: dict[str, AcceptanceEstimate] = {}
        self.plans: dict[str, tuple[int, int, int]] = {}  # request id -> (reload start step, verify step, ring)

    @property
    def vericache(self) -> bool:
        return self.cfg.policy == "vericache"

    # ---- sizes ----
    def resident_blocks(self, seq: Sequence, compressed_len: int) -> dict[str, int]:
        """Blocks a sequence holds for its whole life (what its admission must fit)."""
        bs, new = self.cfg.block_size, seq.request.max_new_tokens
        room = new + self.cfg.k_max + 2  # emitted tokens + one round's drafts + the bonus
        if self.cfg.policy == "full":
            return {"full": math.ceil((seq.prompt_len + new + 1) / bs)}
        if self.cfg.policy == "lossy":
            return {"draft": math.ceil((compressed_len + new + 1) / bs)}
        tail = seq.prompt_len % bs  # the prompt's last partial block stays resident
        return {"draft": math.ceil((compressed_len + room) / bs), "full": math.ceil((tail + room) / bs)}

    def staging_blocks(self, seq: Sequence) -> int:
        return seq.prompt_len // self.cfg.block_size

    def reload_seconds(self, seq: Sequence) -> float:
        nbytes = self.blocks.block_cost("full", self.staging_blocks(seq))
        return 0.0 if self.cfg.link_bytes_per_s is None else nbytes / self.cfg.link_bytes_per_s

    def ring_layers(self, seq: Sequence) -> int:
        """Layers staged ahead so that the verify forward (one step) does not wait on the link:
        the part of the reload the forward cannot overlap, plus double buffering."""
        if self.cfg.staging_layers is not None:
            return min(self.cfg.staging_layers, self.num_layers)
        t = self.reload_seconds(seq)
        ahead = 0 if t <= self.step_s else math.ceil(self.num_layers * (1 - self.step_s / t))
        return min(self.num_layers, ahead + 2)

    def staging_bytes(self, seq: Sequence, ring: int | None = None) -> int:
        return self.blocks.block_cost("full", self.staging_blocks(seq), ring or self.ring_layers(seq))

    def prefill_bytes(self, seq: Sequence) -> int:
        """A prefill's transient KV: one layer of the prompt (full-KV prefills write into their own blocks)."""
        return 0 if self.cfg.policy == "full" else seq.prompt_len * self.full_bytes_per_token // self.num_layers

    def transient_bytes(self, seq: Sequence) -> int:
        """Besides its blocks, what a row needs at times: its prefill's layer, later (VeriCache) a staging ring."""
        return max(self.prefill_bytes(seq), self.staging_bytes(seq, ring=2) if self.vericache else 0)

    def check_fits(self, seq: Sequence, compressed_len: int) -> None:
        need = self.blocks.cost(self.resident_blocks(seq, compressed_len)) + self.transient_bytes(seq)
        if self.blocks.budget is not None and need > self.blocks.budget:
            raise ValueError(
                f"request {seq.request_id!r} needs {need} bytes of device KV under policy "
                f"{self.cfg.policy!r}, more than the whole budget of {self.blocks.budget}"
            )
        if seq.prompt_len + seq.request.max_new_tokens > self.max_context:
            raise ValueError(
                f"request {seq.request_id!r}: {seq.prompt_len} prompt + {seq.request.max_new_tokens} "
                f"new tokens exceed the model's context of {self.max_context}"
            )

    # ---- admission ----
    def admit(self, compressed_len) -> None:
        """Admit waiting requests in arrival order while their blocks, their prefill, the staging already
        planned and (VeriCache) their reloads fit."""
        while self.waiting and len(self.running) + len(self.prefilling) < self.cfg.max_rows:
            seq = self.waiting[0]
            need = self.resident_blocks(seq, compressed_len(seq))
            extra = self.blocks.cost(need) + self.transient_bytes(seq)
            if self.vericache:  # and still room for any row's smallest staging ring, beyond what is planned
                extra = (
                    self.blocks.cost(need)
                    + max([self.transient_bytes(seq)] + [self.staging_bytes(s, ring=2) for s in self.running])
                    + self.rings.peak_memory(self.step)
                )
                if not self._link_admits(seq):
                    return
            if not self.blocks.fits(extra):
                return
            self.waiting.popleft()
            seq.blocks = {pool: self.blocks.allocate(pool, n) for pool, n in need.items()}
            seq.phase = Phase.PREFILL
            self.prefilling.append(seq)

    def _link_admits(self, seq: Sequence) -> bool:
        """Would the link keep up with one more row's reloads at the longest horizon (one reload of every
        row per k_max steps)?"""
        if self.cfg.link_bytes_per_s is None or not (self.running or self.prefilling):
            return True
        rows = self.running + list(self.prefilling) + [seq]
        return sum(self.reload_seconds(s) for s in rows) <= self.cfg.k_max * self.step_s

    # ---- VeriCache rounds ----
    def start_round(self, seq: Sequence) -> None:
        """Pick this round's horizon and plan its reload + verification on the rings."""
        est = self.estimates.setdefault(seq.request_id, AcceptanceEstimate(self.cfg.alpha_prior))
        seq.alpha = est.alpha
        cap = self.draft_cap(seq)
        if self.cfg.horizon is not None:
            x = self.cfg.horizon
        else:
            s = self.reload_seconds(seq) / self.step_s
            rows = max(1, len(self.running))
            link_min = math.ceil(rows * s) if self.cfg.link_bytes_per_s else 0
            x = choose_horizon(est.alpha, self.cfg.k_min, self.cfg.k_max, self.cfg.verify_cost, s, link_min)
        seq.horizon = max(1, min(x, cap))
        seq.verify_step = None
        self.plan(seq)

    def plan(self, seq: Sequence) -> None:
        """Reserve the earliest verify step after the horizon whose reload fits the link and memory rings: with
        the ring that keeps the forward from waiting if its staging fits, else a smaller one (down to double
        buffering: the forward then waits on the link for the layers it could not stage ahead)."""
        link_steps = reload_steps(
            self.blocks.block_cost("full", self.staging_blocks(seq)), self.cfg.link_bytes_per_s, self.step_s
        )
        free = (1 << 62) if self.blocks.budget is None else self.blocks.budget - self.blocks.resident
        earliest = self.step + max(0, seq.horizon - len(seq.drafts))
        want = self.ring_layers(seq)
        for ring in sorted({want, max(2, want // 2), 2}, reverse=True):
            ring = min(ring, self.num_layers)
            lead = math.ceil(link_steps * ring / self.num_layers)  # steps to stage the ring before the forward
            t = self.rings.place(
                self.step, earliest, lead, link_steps, self.staging_bytes(seq, ring), free, seq.request_id
            )
            if t is not None:
                seq.verify_step = t
                self.plans[seq.request_id] = (t - lead, t, ring)
                return

    def draft_cap(self, seq: Sequence) -> int:
        """Most drafts this round: k_max, the tokens still wanted, and the room left in the context."""
        room = self.max_context - (seq.prompt_len + len(seq.output)) - 1
        return max(0, min(self.cfg.k_max, seq.remaining, room))

    def due_reloads(self) -> list[Sequence]:
        """Rows whose planned reload starts now (or was delayed), in plan order."""
        due = [
            s
            for s in self.running
            if s.reload is None and s.request_id in self.plans and self.plans[s.request_id][0] <= self.step
        ]
        return sorted(due, key=lambda s: self.plans[s.request_id][1])

    def segments(self) -> list[Segment]:
        """This step's rows (see the module docstring)."""
        out, streaming = [], []
        in_flight = sorted(
            (s.reload for s in self.running if s.reload is not None and not s.reload.done), key=lambda r: r.submitted_s
        )
        head = in_flight[:1]
        for seq in self.running:
            pos = seq.prompt_len + len(seq.output) - 1  # pending's true position
            if self.cfg.policy == "full":
                out.append(Segment(seq, "full", [seq.pending], [pos], seq.blocks["full"], seq.full_len, "decode"))
            elif self.cfg.policy == "lossy":
                out.append(Segment(seq, "draft", [seq.pending], [pos], seq.blocks["draft"], seq.draft_len, "decode"))
            elif self._verify_ok(seq, head, streaming):
                seq.phase = Phase.VERIFYING
                toks = [seq.pending] + seq.drafts
                view = seq.staging + seq.blocks["full"]
                out.append(
                    Segment(
                        seq, "full", toks, list(range(pos, pos + len(toks))), view, seq.full_len, "verify", seq.reload
                    )
                )
            elif len(seq.drafts) < self.draft_cap(seq):
                last = seq.drafts[-1] if seq.drafts else seq.pending
                out.append(
                    Segment(seq, "draft", [last], [pos + len(seq.drafts)], seq.blocks["draft"], seq.draft_len, "draft")
                )
        return out

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

    def finish(self, seq: Sequence) -> None:
        for pool, ids in seq.blocks.items():
            self.blocks.free(pool, ids)
        seq.blocks = {}
        self.release_staging(seq)
        if seq in self.running:
            self.running.remove(seq)
        self.estimates.pop(seq.request_id, None)

    def release_staging(self, seq: Sequence) -> None:
        """After a verification (or at the end): free the staging ring and the round's reservations."""
        if seq.staging:
            self.blocks.free("full", seq.staging, seq.staging_ring)
            seq.staging = []
        seq.reload = None
        self.plans.pop(seq.request_id, None)
        self.rings.release(seq.request_id)
