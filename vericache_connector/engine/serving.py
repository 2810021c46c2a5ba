"""ServingEngine: requests arrive over time, are admitted under a device KV budget, decode in one continuous
batch, finish and leave. nano-vllm's shape: add_request() queues a request, step() runs one step (the scheduler
decides: scheduler.py, admission, the reload plans (rounds.py), what runs; the engine runs it: model_runner.py
computes, host_tier.py moves full KV, executor.py places a prompt's KV and picks each row's token by the sampling
and the accept rule of model/sampling.py; the scheduler applies the results: postprocess), has_unfinished() says
whether any request is left; run(trace) is a loop over them.

    engine = ServingEngine(model, ServingConfig(policy="vericache", budget_bytes=..., link_bytes_per_s=...))
    report = engine.run([Request("a", prompt_ids, 128, arrival_s=0.0), ...])
    report.tokens_per_s, report.outputs()

    engine.add_request(Request("b", prompt_ids, 64))        # a server's loop: add requests as they come
    while engine.has_unfinished():
        for request_id, tokens in engine.step(): ...         # the tokens each request emitted this step

Every policy's greedy output is each request's own single-request full-KV greedy output, except "lossy"
(shown for reference): VeriCache verifies every draft on the full KV before it is emitted. Where a round
happens: a VeriCache row drafts one token per step (a "draft" segment) until its planned verify step, whose
"verify" segment runs [pending, d_1..d_k] over the reloaded full KV in the same packed forward. Where VeriCache
does not pay, rows decode on full KV instead (fallback.py: the capacity model before rows run, the guard while
they do).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from ..compressors import get_compressor
from . import capacity
from .block_manager import BlockManager
from .config import ServingConfig
from .executor import StepExecutor
from .fallback import FallbackDecision
from .guard import Guard
from .host_tier import Link, ReloadFailed
from .model_runner import Batch, ModelRunner, Prefilled, Sampled
from .pools import PoolLayout
from .prompt_kv import PromptPlacer
from .report import ServingReport, TimeSplit, observed_alpha
from .scheduler import Scheduler
from .sequence import Request, Sequence
from .sizes import RowSizes

SEEN_ROWS = 256  # the acceptances of the last rows seen, for the capacity model
STALL_LIMIT_S = 5.0  # idle with nothing to wait for this long: raise instead of spinning


class ServingEngine(FallbackDecision):
    """See the module docstring; where rows go on full KV is FallbackDecision's (fallback.py)."""

    def __init__(self, model, cfg: ServingConfig, prefill_store: dict | None = None):
        """prefill_store: a dict shared by engines serving the same prompts (benchmarks): each prompt's forward
        runs once, later prefills replay its layers (see ModelRunner.prefill)."""
        self.model, self.cfg, self.prefill_store = model, cfg, prefill_store
        mc = model.cfg
        self.full_bytes_per_token = mc.kv_bytes_per_token(model.dtype.itemsize)
        self.compressor = get_compressor(cfg.compressor) if cfg.policy != "full" else None
        if self.compressor is not None and self.compressor.needs_queries and not cfg.obs_window:
            raise ValueError(f"compressor {cfg.compressor!r} needs observation queries: obs_window must be > 0")
        self.layout = PoolLayout(cfg, model, self.compressor)  # pools.py: which pools, their layout and blocks
        self.full_dtype, self.packed, self.complement = (
            self.layout.full_dtype,
            self.layout.packed,
            self.layout.complement,
        )
        inv_freq = getattr(model, "inv_freq", None)
        self.placer = PromptPlacer(
            self.compressor,
            self.packed,
            self.complement,
            cfg.block_size,
            None if inv_freq is None else inv_freq.float().cpu(),
            prefill_store,
        )
        self.sizes = RowSizes(
            cfg, self.layout.block_bytes, mc.num_layers, self.full_bytes_per_token, self.draft_lens, self.complement
        )
        self.acceptance = None  # acceptance(seq, k) -> accepted count: replayed acceptance (see run)
        # what this engine has seen, across runs, for the capacity model: the acceptance of each VeriCache row that
        # verified (its rounds' own, AcceptanceEstimate.observed), and what its steps cost beyond their roofline
        # ((per step, per verification) seconds; measured with cfg.hardware)
        self.seen_alphas: list[float] = []
        self.overhead: tuple[float, float] | None = None
        # what a VeriCache prefill adds to the prompt's forward (compression, packing, the host copy), measured per
        # row (EMA); the capacity model's prefill_s once measured (engine/calibrate.py's estimate before)
        self.prefill_added_s: float | None = None
        params = list(model.parameters())
        self._step_wl = capacity.Workload(
            sum(p.numel() * p.element_size() for p in params),
            sum(p.numel() for p in params),
            self.full_bytes_per_token,
            mc.num_layers,
            0,
            0,
            attn_flops_per_pair=4 * mc.num_heads * mc.head_dim * mc.num_layers,
        )
        self._reset()

    def _reset(self) -> None:
        """No requests, nothing allocated: the next step (or run) starts serving afresh."""
        self.seqs: list[Sequence] = []
        self.scheduler = self.pools = self.link = self.runner = self.executor = self.prediction = None
        self.split, self.reload_failures, self._stalled_s, self.t0 = TimeSplit(), 0, 0.0, None
        self.guard, self._full_rate, self.guard_tripped_s = Guard(self.cfg.guard_margin), None, None
        self._decided: set[int] = set()  # the rows (id of their Sequence) a planner decision was made for

    @staticmethod
    @torch.inference_mode()
    def precompute_prefills(model, prompts: list[list[int]], obs_window: int, store: dict | None = None) -> dict:
        """A prefill store with every prompt's forward (computed once; keyed for with and without observation
        queries), for engines that serve the same prompts (ServingEngine(..., prefill_store=...))."""
        store = {} if store is None else store
        runner = ModelRunner(model, {})
        for p in prompts:
            if (tuple(p), obs_window) in store:
                continue
            runner.prefill(p, obs_window, lambda *a: None, store)
            logits, layers = store[(tuple(p), obs_window)]
            store[(tuple(p), 0)] = (logits, [(k, v, None) for k, v, _ in layers])
        return store

    def draft_lens(self, seq: Sequence) -> tuple[int, int]:
        """(entries of the compressed prompt in the packed pool, in the draft pool): prompt_kv.py."""
        return self.placer.lens(seq.request.prompt_ids)

    def compressed_len(self, seq: Sequence) -> int:
        return sum(self.draft_lens(seq))

    def check(self, trace: list[Request]) -> None:
        """ValueError naming the request and the value, before anything is allocated for the trace."""
        mc = self.model.cfg
        ids = [r.request_id for r in trace] + [s.request_id for s in self.seqs]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids in a trace must be unique")
        for r in trace:
            bad = next((t for t in r.prompt_ids if t >= mc.vocab_size), None)
            if bad is not None:
                raise ValueError(
                    f"request {r.request_id!r}: token id {bad} is outside the vocabulary [0, {mc.vocab_size})"
                )
            if len(r.prompt_ids) + r.max_new_tokens > mc.max_position:
                raise ValueError(
                    f"request {r.request_id!r}: {len(r.prompt_ids)} prompt + {r.max_new_tokens} new tokens exceed "
                    f"the model's context of {mc.max_position}"
                )
            need, budget = self.sizes.need(Sequence(r), self.cfg.policy == "full"), self.cfg.budget_bytes
            if budget is not None and need > budget:
                raise ValueError(
                    f"request {r.request_id!r} needs {need} bytes of device KV under policy "
                    f"{self.cfg.policy!r}, more than the whole budget of {budget}"
                )

    def add_request(self, request: Request) -> None:
        """Serve `request` from its arrival_s on (seconds on the engine's clock, which starts at the first step; a
        time already past means now). ValueError naming the value for a request that could never be served."""
        self.check([request])
        seq = Sequence(request, generator=torch.Generator().manual_seed(request.seed))
        seq.arrival_s = max(request.arrival_s, self.now())
        self.seqs.append(seq)
        if self.scheduler is not None:
            self.scheduler.add(seq)

    def has_unfinished(self) -> bool:
        return any(s.finished_s is None for s in self.seqs)

    @torch.inference_mode()
    def step(self) -> list[tuple[str, list[int]]]:
        """One step: schedule -> run -> postprocess. -> (request id, the tokens it emitted) per request that
        emitted any."""
        if self.scheduler is None:
            self._start()
        self._decide()
        batch = self.scheduler.schedule(self.now())
        if batch.empty:
            self._idle()
            return []
        t = time.perf_counter()
        if batch.prefill is not None:
            result, compute_s = self._prefill(batch.prefill), 0.0
            self.split.prefill_s += time.perf_counter() - t
        else:
            got = self._packed_step(batch)
            if got is None:
                return []
            result, compute_s = got
        emitted = self.scheduler.postprocess(batch, result, self.now(), compute_s)
        if batch.prefill is None:  # the guard's measurement: what this step took and emitted
            dt, kinds = time.perf_counter() - t, [seg.kind for seg in batch.segments]
            if "draft" in kinds or "verify" in kinds:
                self.guard.observe(dt, sum(n for _, n in emitted), kinds.count("verify"))
            else:
                self.guard.observe_full(len(kinds), dt)
        for seq, _ in emitted:
            if seq.finished_s is not None and seq.drafted:
                self.seen_alphas = (self.seen_alphas + [observed_alpha(seq.accepted, seq.drafted)])[-SEEN_ROWS:]
        return [(seq.request_id, seq.output[len(seq.output) - n :]) for seq, n in emitted if n]

    def run(self, trace: list[Request], on_tokens=None, acceptance=None) -> ServingReport:
        """Serve the trace in real time (arrivals by the wall clock, from now) and report; on_tokens(n) after each
        emission; acceptance(seq, k) -> accepted count replays recorded acceptance instead of comparing tokens (the
        GPU script's random-weight model), outputs then are not meaningful."""
        self._reset()
        self.acceptance = acceptance
        for r in sorted(trace, key=lambda r: r.arrival_s):
            self.add_request(r)  # each checked; nothing is allocated before the first step
        try:
            while self.has_unfinished():
                for _, tokens in self.step():
                    if on_tokens is not None:
                        on_tokens(len(tokens))
        finally:
            self.close()
        return self.report()

    def report(self) -> ServingReport:
        """What the finished requests measured (ServingReport), with the capacity model's prediction if it made one."""
        seqs = [s for s in self.seqs if s.finished_s is not None]
        if not seqs:
            raise ValueError("no request has finished yet: nothing to report")
        rep = ServingReport.build(
            self.cfg, seqs, self.now(), self.split, self.scheduler, self.link, self.reload_failures
        )
        if self.prediction is not None:
            rep.prediction = {**dataclasses.asdict(self.prediction), "speedup": self.prediction.speedup}
        rep.step_overhead_s, rep.verify_overhead_s = self.overhead or (None, None)
        rep.prefill_overhead_s = self.prefill_added_s
        return rep

    def close(self) -> None:
        """Stop the link's copy thread (a later reload starts it again)."""
        if self.link is not None:
            self.link.close()

    def _start(self) -> None:
        """The pools (sized for the requests known now), the budget, the link and the scheduler; the clock starts."""
        cfg = self.cfg
        self.pools = self.layout.make(self.seqs, self.sizes)
        blocks = BlockManager(self.pools, cfg.budget_bytes)
        self.link = Link(cfg.link_bytes_per_s, self.model.device) if cfg.policy == "vericache" else None
        mc = self.model.cfg
        self.scheduler = Scheduler(cfg, blocks, self.sizes, mc.max_position, mc.eos_token_ids, self.link)
        for s in self.seqs:
            self.scheduler.add(s)
        self.runner = ModelRunner(self.model, self.pools, cfg.backend)
        self.executor = StepExecutor(
            cfg, self.model, self.pools, self.runner, self.placer, self.layout, self.prefill_store
        )
        self.t0 = time.perf_counter()

    def now(self) -> float:
        """Seconds on the engine's clock (0 until the first step)."""
        return 0.0 if self.t0 is None else time.perf_counter() - self.t0

    # ---- run: one prefill (executor.py), one packed forward (model_runner.py, then executor.py) ----
    def _prefill(self, seq: Sequence) -> Prefilled:
        """The prompt's prefill (StepExecutor.prefill), and what VeriCache added to its forward (EMA)."""
        result, added = self.executor.prefill(seq)
        if added is not None:
            m = self.prefill_added_s
            self.prefill_added_s = added if m is None else 0.8 * m + 0.2 * added
        return result

    def _packed_step(self, batch: Batch) -> tuple[dict[int, Sampled], float] | None:
        """Every running row's tokens in one forward; then each row's token: sampled (decode, draft) or by the
        accept rule (verify). None when a reload failed (its KV recomputed; the verifications retry)."""
        try:
            logits, dt, wait = self.runner.step(batch.segments)
        except ReloadFailed:
            for seg in batch.segments:
                if seg.kind == "verify" and seg.reload is not None and seg.reload.error is not None:
                    self.reload_failures += 1
                    self.executor.recompute_full(seg.seq)
            self.scheduler.verify_failed(batch)
            return None
        self._stalled_s = 0.0
        self.split.add_step({s.kind for s in batch.segments}, dt, wait)
        if self.cfg.hardware is not None and self.cfg.policy == "vericache":
            self._measure_overhead(batch.segments, dt - wait)
        return self.executor.tokens(batch, logits, self.acceptance), dt - wait

    # ---- nothing to compute ----
    def _idle(self) -> None:
        """Wait for the link (a reload in flight, or one started early), or for the next arrival."""
        t = time.perf_counter()
        sched = self.scheduler
        reload = sched.reload_to_wait_for()
        if reload is not None:
            reload.layer_ready[-1].wait(0.5)
            self.split.link_wait_s += time.perf_counter() - t
            self.guard.observe(time.perf_counter() - t, 0, 0)
            return
        if sched.arrivals:
            delay = sched.arrivals[0].arrival_s - self.now()
            if delay > 0:
                time.sleep(min(delay, 0.5))
        else:  # nothing running can move, nothing in flight, nothing to arrive: the scheduler is stuck
            self._stalled_s += time.perf_counter() - t + 0.001
            time.sleep(0.001)
            if self._stalled_s > STALL_LIMIT_S:
                state = [(s.request_id, s.phase.value, len(s.drafts), s.horizon, s.verify_step) for s in sched.running]
                raise RuntimeError(
                    f"serving is stuck (a scheduler bug): rows {state}, waiting "
                    f"{[s.request_id for s in sched.waiting]}, paused {[s.request_id for s in sched.paused]}, "
                    f"{sched.blocks.resident} of "
                    f"{sched.blocks.budget} bytes in use"
                )
        self.split.idle_s += time.perf_counter() - t
