"""Where VeriCache does not pay, the serving engine's rows go on full KV (Scheduler.fallback, moves.py): the
decision, and what the engine measures for it. A part of ServingEngine (its base class): the methods use the
engine's state (ServingEngine.__init__, _reset).

  before VeriCache rows run   the planner: the capacity model (capacity.py) on cfg.hardware for the requests at
                              hand (predict), with what this engine has measured; where it predicts VeriCache /
                              full KV <= 1 + cfg.fallback_margin, they are admitted on full KV
  while they run              the guard (guard.py): where their measured rate is below full KV's, rows move to
                              full KV

What the capacity model is given, measured across runs: the acceptance of each VeriCache row that verified
(ServingEngine.step), what a VeriCache step costs beyond its roofline, per step and per verification
(_measure_overhead, with cfg.hardware), and what a VeriCache prefill adds to the prompt's forward
(ServingEngine._prefill).
"""

from __future__ import annotations

import dataclasses

from . import capacity
from .model_runner import Segment
from .sequence import Request


class FallbackDecision:
    """ServingEngine's decision to serve on full KV (see the module docstring)."""

    def _decide(self) -> None:
        """Where VeriCache does not pay, rows go on full KV (Scheduler.fallback). Before VeriCache rows run (nothing
        admitted, requests waiting or to arrive), the planner: the capacity model (cfg.hardware) for those requests;
        where it predicts VeriCache / full KV <= 1 + cfg.fallback_margin, they are admitted on full KV. While they
        run, the guard (guard.py): where their measured rate is below full KV's, rows move to full KV.
        A decision holds for the requests it was made for: the engine empties between waves (a budget that holds a
        few rows), and the rest of a trace is not re-predicted alone (a tail of two rows looks better to the model
        than it serves) nor moved back to VeriCache after the guard measured a loss. Requests added since are
        decided afresh, with everything known then."""
        s, cfg = self.scheduler, self.cfg
        if cfg.policy != "vericache":
            return
        if not (s.running or s.prefilling or s.paused):
            self.guard.reset()
            pending = list(s.waiting) + s.arrivals
            if not any(id(q) not in self._decided for q in pending):
                return
            self._decided.update(id(q) for q in pending)
            s.fallback = False
            if cfg.hardware is not None:
                pred = self.predict([q.request for q in pending])
                s.fallback = cfg.planner and pred.speedup <= 1 + cfg.fallback_margin
                self.prediction, self._full_rate = self.prediction or pred, pred.full_tokens_per_s
            return
        rows = [q for q in s.running if not q.full_kv]
        reload_s = max((s.reload_seconds(q) for q in rows), default=0.0)
        if cfg.guard and not s.fallback and self.guard.loses(rows, self._full_rate, reload_s):
            s.fallback, self.guard_tripped_s = True, self.now()

    def predict(self, trace: list[Request]) -> capacity.Prediction:
        """The capacity model (engine/capacity.py) for these requests on cfg.hardware, with the acceptance of the
        rows this engine has seen (else cfg.alpha_rows, else cfg.alpha_prior) and the overheads it measured (per
        step, per verification, per VeriCache prefill; else the configured ones)."""
        hw = self.cfg.hardware
        if self.overhead is not None:
            hw = dataclasses.replace(hw, step_overhead_s=self.overhead[0], verify_overhead_s=self.overhead[1])
        alphas = self.seen_alphas or list(self.cfg.alpha_rows) or self.cfg.alpha_prior
        return capacity.for_trace(self, trace, alphas, hw, prefill_s=self.prefill_added_s)

    def _measure_overhead(self, segments: list[Segment], compute_s: float) -> None:
        """What a step with VeriCache rows took beyond its roofline (capacity.pass_s at this step's shape, on
        cfg.hardware): EMAs over steps without a verification, and per verification over the steps with some."""
        if not any(seg.kind in ("draft", "verify") for seg in segments):
            return
        per = {p: b / self.cfg.block_size for p, b in self.sizes.block_bytes.items()}
        kv = tokens = dense = draft = verifies = 0
        for seg in segments:
            q, n = len(seg.tokens), seg.start + len(seg.tokens)
            tokens += q
            if seg.pool == "full":
                dense, kv, verifies = dense + q * n, kv + n * per["full"], verifies + (seg.kind == "verify")
            else:
                draft += q * (n + seg.packed_len)
                kv += n * per["draft"] + seg.packed_len * per.get("packed", 0)
        left = compute_s - capacity.pass_s(self.cfg.hardware, self._step_wl, kv, tokens, dense, draft)
        step, verify = self.overhead or (None, 0.0)
        if not verifies:
            step = left if step is None else 0.8 * step + 0.2 * left
        elif step is not None:
            verify = 0.8 * verify + 0.2 * (left - step) / verifies
        if step is not None:
            self.overhead = (step, verify)
