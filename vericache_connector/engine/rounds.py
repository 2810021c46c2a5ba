"""The VeriCache rounds of the serving scheduler (a part of Scheduler: scheduler.py's class is made with it).

A VeriCache row's round: it starts with a horizon (planner.choose_horizon, at the row's acceptance estimate and
the measured costs of draft and verify steps), planned on the reservation rings of planner.py (the earliest
verify step after the horizon whose reload fits the link and the memory ring, with the staging ring that keeps the
verify forward from waiting on the link where that fits); the reload goes on the link when its plan says (a
ring of staging layers in the full pool), the row verifies in the packed forward at its verify step, and the
staging and the round's reservations are freed after. With nothing to compute, the engine waits for the reload
in flight (reload_to_wait_for). Only rows of the vericache policy have rounds.

The methods read and write the scheduler's state (Scheduler.__init__): cfg, blocks, sizes, link, num_layers,
max_context, running, step, step_s, draft_s, verify_s, rings, estimates and plans.
"""

from __future__ import annotations

import math

from .block_manager import BudgetExceeded
from .planner import AcceptanceEstimate, choose_horizon, reload_steps
from .sequence import Phase, Sequence


class VeriCacheRounds:
    """The rounds and reloads of Scheduler (see the module docstring); no state of its own."""

    # ---- sizes of a reload (sizes.py: the formula the capacity model shares) ----
    def staging_blocks(self, seq: Sequence) -> int:
        return self.sizes.staging_blocks(seq)

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
        return self.sizes.staging_bytes(seq, ring or self.ring_layers(seq))

    # ---- a round: its horizon and its plan on the rings ----
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
            x = choose_horizon(est.alpha, self.cfg.k_min, self.cfg.k_max, self.verify_cost(rows), s, link_min)
        seq.horizon = max(1, min(x, cap))
        seq.verify_step = None
        self.plan(seq)

    def verify_cost(self, rows: int) -> float:
        """A verification's cost in draft steps of its row: the step it does not draft in (cfg.verify_cost), plus
        what its [pending, drafts] over the full KV add to that step, which every one of the batch's rows waits
        for (measured: verify steps against draft steps). Over a horizon x a batch of B rows then emits
        B E(x) tokens per (x + 1) t_draft + B extra: E(x) / (x + verify_cost) is what to maximize."""
        if self.draft_s is None or self.verify_s is None or self.draft_s <= 0:
            return self.cfg.verify_cost
        return self.cfg.verify_cost + rows * max(0.0, self.verify_s - self.draft_s) / self.draft_s

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
        rings = [self.num_layers] if seq.moving else sorted({want, max(2, want // 2), 2}, reverse=True)
        for ring in rings:
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

    # ---- reloads on the link ----
    def start_reload(self, seq: Sequence, ring: int | None = None) -> bool:
        """Put the row's prompt KV on the link into a staging ring (not now if the budget is held by a prefill:
        the next step tries again). -> whether it went on the link."""
        if ring is None:
            ring = self.plans[seq.request_id][2] if seq.request_id in self.plans else self.ring_layers(seq)
        n = self.staging_blocks(seq)
        try:
            seq.staging = self.blocks.allocate("full", n, ring) if n else []
        except BudgetExceeded:
            return False
        seq.staging_ring = ring
        seq.reload = self.link.submit(seq.host, self.blocks.pools["full"], seq.staging, ring)
        seq.phase = Phase.RELOADING
        return True

    def reload_to_wait_for(self):
        """Nothing can compute: the reload in flight, else the next planned row's started now on the smallest
        ring (admission kept room for it); None when there is none (VeriCache only)."""
        if self.link is None:
            return None
        inflight = [s.reload for s in self.running if s.reload is not None and not s.reload.done]
        if not inflight:
            waiting = sorted(
                (s for s in self.running if s.reload is None and not s.full_kv),
                key=lambda s: (s.verify_step is None, s.verify_step or 0),
            )
            for seq in waiting[:1]:
                self.start_reload(seq, ring=self.num_layers if seq.moving else 2)
            inflight = [s.reload for s in self.running if s.reload is not None and not s.reload.done]
        return inflight[0] if inflight else None

    def release_staging(self, seq: Sequence) -> None:
        """After a verification (or at the end): free the staging ring and the round's reservations."""
        if seq.staging:
            self.blocks.free("full", seq.staging, seq.staging_ring)
            seq.staging = []
        seq.reload = None
        self.plans.pop(seq.request_id, None)
        self.rings.release(seq.request_id)
