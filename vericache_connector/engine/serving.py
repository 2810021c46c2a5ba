"""ServingEngine: requests arrive over time, are admitted under a device KV budget, decode in one continuous
batch, finish and leave (scheduler.py decides, model_runner.py computes, host_tier.py moves full KV).

    engine = ServingEngine(model, ServingConfig(policy="vericache", budget_bytes=..., link_bytes_per_s=...))
    report = engine.run([Request("a", prompt_ids, 128, arrival_s=0.0), ...])
    report.tokens_per_s, report.outputs()

Every policy's greedy output is each request's own single-request full-KV greedy output, except "lossy"
(shown for reference): VeriCache verifies every draft on the full KV before it is emitted.
"""

from __future__ import annotations

import time

import torch

from ..compressors import PrefixKV, get_compressor
from ..model.sampling import accept_greedy, accept_sampling, probs, sample
from .block_manager import BlockManager, BudgetExceeded, KVPool
from .host_tier import HostEntry, Link, ReloadFailed, to_host_blocks
from .model_runner import ModelRunner
from .planner import AcceptanceEstimate
from .report import ServingReport, TimeSplit
from .scheduler import Scheduler, ServingConfig
from .sequence import Phase, Request, Sequence

STALL_LIMIT_S = 5.0  # idle with nothing to wait for this long: raise instead of spinning
RELOADS_STAGED = 3  # staging areas the full pool has room for at once (the budget decides how many are used)
MODEL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class ServingEngine:
    def __init__(self, model, cfg: ServingConfig, prefill_store: dict | None = None):
        """prefill_store: a dict shared by engines serving the same prompts (benchmarks): each prompt's forward
        runs once, later prefills replay its layers (see ModelRunner.prefill)."""
        self.model, self.cfg, self.prefill_store = model, cfg, prefill_store
        mc = model.cfg
        self.full_dtype = MODEL_DTYPES[model.dtype]
        self.full_bytes_per_token = mc.kv_bytes_per_token(model.dtype.itemsize)
        self.compressor = get_compressor(cfg.compressor) if cfg.policy != "full" else None
        if self.compressor is not None and self.compressor.needs_queries and not cfg.obs_window:
            raise ValueError(f"compressor {cfg.compressor!r} needs observation queries: obs_window must be > 0")

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

    def compressed_len(self, seq: Sequence) -> int:
        keep = getattr(self.compressor, "keep_count", None)
        return keep(seq.prompt_len) if keep is not None else seq.prompt_len

    def _pools(self, seqs: list[Sequence]) -> dict[str, KVPool]:
        """The pools' physical blocks: as many as the budget can pay for (all of the trace's demand without a
        budget), plus, for VeriCache, whole staging areas for a few reloads (a staging ring holds a prompt's
        blocks in every layer of the pool's layout, while the budget counts only the ring's layers)."""
        mc, bs, dev = self.model.cfg, self.cfg.block_size, self.model.device
        shape = (mc.num_layers, mc.num_kv_heads, mc.head_dim, bs)
        demand = sum(
            self.full_bytes_per_token * (s.prompt_len + s.request.max_new_tokens + self.cfg.k_max + bs) for s in seqs
        )
        cap = demand if self.cfg.budget_bytes is None else self.cfg.budget_bytes
        dtypes = {"full": self.full_dtype, "draft": self.cfg.draft_dtype}
        names = {"full": ["full"], "lossy": ["draft"], "vericache": ["draft", "full"]}[self.cfg.policy]
        pools = {}
        for name in names:
            per_block = mc.kv_bytes_per_token(getattr(torch, dtypes[name]).itemsize) * bs
            blocks = cap // per_block + len(seqs) + 2
            if self.cfg.policy == "vericache" and name == "full":
                blocks += RELOADS_STAGED * max(s.prompt_len // bs for s in seqs)
            pools[name] = KVPool(name, *shape, dtypes[name], blocks, dev)
        return pools

    @torch.inference_mode()
    def run(self, trace: list[Request], on_tokens=None, acceptance=None) -> ServingReport:
        """Serve the trace in real time (arrivals by the wall clock); on_tokens(n) after each emission;
        acceptance(seq, k) -> accepted count replays recorded acceptance instead of comparing tokens (the GPU
        script's random-weight model), outputs then are not meaningful."""
        cfg = self.cfg
        seqs = [
            Sequence(r, generator=torch.Generator().manual_seed(r.seed))
            for r in sorted(trace, key=lambda r: r.arrival_s)
        ]
        if len({s.request_id for s in seqs}) != len(seqs):
            raise ValueError("request ids in a trace must be unique")
        pools = self._pools(seqs)
        blocks = BlockManager(pools, cfg.budget_bytes)
        sched = Scheduler(cfg, blocks, self.full_bytes_per_token, self.model.cfg.max_position)
        for s in seqs:
            sched.check_fits(s, self.compressed_len(s))
        runner = ModelRunner(self.model, pools, cfg.backend)
        link = Link(cfg.link_bytes_per_s, self.model.device) if cfg.policy == "vericache" else None
        self.host: dict[str, HostEntry] = {}
        self._state = (sched, runner, link, pools, on_tokens, acceptance)
        split, arrivals = TimeSplit(), list(seqs)
        self.reload_failures, self._stalled_s = 0, 0.0
        t0 = time.perf_counter()
        self.t0 = t0
        try:
            while any(s.phase != Phase.FINISHED for s in seqs):
                now = time.perf_counter() - t0
                while arrivals and arrivals[0].request.arrival_s <= now:
                    sched.waiting.append(arrivals.pop(0))
                sched.admit(self.compressed_len)
                if sched.prefilling:
                    self._prefill(sched.prefilling.popleft(), split)
                    continue
                if not self._decode_step(split):
                    self._idle(arrivals, split)
        finally:
            if link is not None:
                link.close()
        makespan = time.perf_counter() - t0
        return ServingReport.build(cfg, seqs, makespan, split, blocks, link, self.reload_failures)

    # ---- one prefill ----
    def _prefill(self, seq: Sequence, split: TimeSplit) -> None:
        """The prompt's forward, layer by layer: full KV -> its own blocks (full), or -> the compressor and the
        draft pool (lossy, vericache) and the host tier + the resident tail (vericache)."""
        sched, runner, link, pools, on_tokens, _ = self._state
        t = time.perf_counter()
        seq.admitted_s = t - self.t0
        held = sched.prefill_bytes(seq)
        sched.blocks.hold(held)
        policy, bs = self.cfg.policy, self.cfg.block_size
        stored = seq.prompt_len // bs * bs
        host = HostEntry([], [], stored)
        pin = self.model.device.type == "cuda"

        def on_layer(layer: int, k: torch.Tensor, v: torch.Tensor, obs: torch.Tensor | None) -> None:
            if policy == "full":
                full = pools["full"]
                full.write(layer, full.slots(seq.blocks["full"], 0, k.shape[1]), k.transpose(0, 1), v.transpose(0, 1))
                return
            comp = self.compressor.compress(PrefixKV([k], [v], None if obs is None else [obs]))
            ck, cv = comp.layer_kv(0, torch.float32)
            draft = pools["draft"]
            draft.write(layer, draft.slots(seq.blocks["draft"], 0, ck.shape[1]), ck.transpose(0, 1), cv.transpose(0, 1))
            seq.draft_len = ck.shape[1]
            if policy == "vericache":
                kb, vb = to_host_blocks(k, v, stored, bs, self.model.dtype, pin)
                host.keys.append(kb)
                host.values.append(vb)
                full = pools["full"]  # the prompt's last partial block stays resident
                full.write(
                    layer,
                    full.slots(seq.blocks["full"], 0, seq.prompt_len - stored),
                    k[:, stored:].transpose(0, 1),
                    v[:, stored:].transpose(0, 1),
                )

        obs = self.cfg.obs_window if self.compressor is not None and self.compressor.needs_queries else 0
        logits = runner.prefill(seq.request.prompt_ids, obs, on_layer, self.prefill_store)
        seq.full_len = seq.prompt_len
        if policy == "vericache":
            self.host[seq.request_id] = host
            seq.stored_prompt = stored
        sched.blocks.release(held)
        first, _ = sample(logits[None], self.cfg.temperature, seq.generator)
        seq.pending = int(first[0])
        split.prefill_s += time.perf_counter() - t
        sched.step += 1
        self._emit(seq, [seq.pending])
        if seq.phase != Phase.FINISHED:
            sched.running.append(seq)
            seq.phase = Phase.DRAFTING if self.cfg.policy == "vericache" else Phase.DECODING
            if self.cfg.policy == "vericache":
                sched.start_round(seq)

    # ---- one decode step ----
    def _decode_step(self, split: TimeSplit) -> bool:
        sched, runner, link, pools, _, _ = self._state
        if link is not None:
            for seq in sched.running:
                if seq.verify_step is None and seq.phase in (Phase.DRAFTING, Phase.RELOADING):
                    sched.plan(seq)
            for seq in sched.due_reloads():
                self._start_reload(seq)
        segments = sched.segments()
        if not segments:
            return False
        try:
            logits, dt, wait = runner.step(segments)
        except ReloadFailed:
            for seg in segments:
                if seg.kind == "verify" and seg.reload is not None and seg.reload.error is not None:
                    self._recompute_full(seg.seq)
            for seg in segments:
                if seg.kind == "verify":
                    seg.seq.phase = Phase.RELOADING
            return True
        self._stalled_s = 0.0
        kinds = {s.kind for s in segments}
        split.add_step(kinds, dt, wait)
        sched.step_s = 0.8 * sched.step_s + 0.2 * (dt - wait) if sched.step > 0 else dt - wait
        sched.step += 1
        sched.rings.advance(sched.step)
        for seg in segments:
            self._after(seg, logits[id(seg.seq)])
        return True

    def _start_reload(self, seq: Sequence, ring: int | None = None) -> None:
        sched, _, link, _, _, _ = self._state
        n = sched.staging_blocks(seq)
        if ring is None:
            ring = sched.plans[seq.request_id][2] if seq.request_id in sched.plans else sched.ring_layers(seq)
        try:
            seq.staging = sched.blocks.allocate("full", n, ring) if n else []
        except BudgetExceeded:  # a prefill holds memory now: try again next step
            return
        seq.staging_ring = ring
        seq.reload = link.submit(self.host[seq.request_id], sched.blocks.pools["full"], seq.staging, ring)
        seq.phase = Phase.RELOADING

    def _recompute_full(self, seq: Sequence) -> None:
        """The reload failed: recompute the prompt's stored part into the staging blocks (exact KV)."""
        _, runner, _, pools, _, _ = self._state
        self.reload_failures += 1
        full = pools["full"]

        def into_staging(layer: int, k: torch.Tensor, v: torch.Tensor, obs) -> None:
            full.write(layer, full.slots(seq.staging, 0, k.shape[1]), k.transpose(0, 1), v.transpose(0, 1))

        runner.prefill(seq.request.prompt_ids[: seq.stored_prompt], 0, into_staging)
        seq.reload = _Ready()

    def _after(self, seg, lg: torch.Tensor) -> None:
        sched, _, _, pools, _, acceptance = self._state
        seq, temp = seg.seq, self.cfg.temperature
        if seg.kind == "decode":
            tok, _ = sample(lg[-1:], temp, seq.generator)
            if self.cfg.policy == "full":
                seq.full_len += 1
            else:
                seq.draft_len += 1
            seq.pending = int(tok[0])
            self._emit(seq, [seq.pending])
            return
        if seg.kind == "draft":
            tok, q = sample(lg[-1:], temp, seq.generator)
            seq.drafts.append(int(tok[0]))
            if q is not None:
                seq.draft_probs.append(q[0])
            seq.draft_len += 1
            return
        # verify: accept the longest prefix the full model agrees with, plus one bonus token
        k, d = len(seq.drafts), torch.tensor([seq.drafts], device=lg.device, dtype=torch.long)
        if acceptance is not None:
            n = min(k, int(acceptance(seq, k)))
            bonus = int(lg[n].argmax())
        elif temp <= 0:
            nt, bt = accept_greedy(d.reshape(1, k), lg[None])
            n, bonus = int(nt[0]), int(bt[0])
        elif k == 0:  # nothing drafted (the verify step came first): one sample of the full-KV distribution
            n, bonus = 0, int(sample(lg[:1], temp, seq.generator)[0][0])
        else:
            q = torch.stack(seq.draft_probs)[None]
            nt, bt = accept_sampling(d.reshape(1, k), q, probs(lg[None], temp), seq.generator)
            n, bonus = int(nt[0]), int(bt[0])
        sched.estimates.setdefault(seq.request_id, AcceptanceEstimate(self.cfg.alpha_prior)).update(n, k)
        seq.accepted.append(n)
        keep, base_full, base_draft = n + 1, seq.full_len, seq.draft_len - k
        full, draft = pools["full"], pools["draft"]
        view = seq.staging + seq.blocks["full"]
        src = full.slots(view, base_full, keep)
        dst = draft.slots(seq.blocks["draft"], base_draft, keep)
        for layer in range(len(full.caches)):  # the draft cache gets the accepted tokens' exact KV
            kc, vc = full.caches[layer]
            bs = full.block_size
            kx = kc[src // bs, :, :, src % bs]
            vx = vc[src // bs, :, src % bs]
            draft.write(layer, dst, kx, vx)
        seq.full_len, seq.draft_len = base_full + keep, base_draft + keep
        new = seq.drafts[:n] + [bonus]
        seq.drafts, seq.draft_probs, seq.pending = [], [], bonus
        sched.release_staging(seq)
        self._emit(seq, new)
        if seq.phase != Phase.FINISHED:
            seq.phase = Phase.DRAFTING
            sched.start_round(seq)

    def _emit(self, seq: Sequence, tokens: list[int]) -> None:
        sched, _, _, _, on_tokens, _ = self._state
        before = len(seq.output)
        done = seq.emit(tokens, self.model.cfg.eos_token_ids, self.cfg.stop_at_eos, time.perf_counter() - self.t0)
        if on_tokens is not None:
            on_tokens(len(seq.output) - before)
        if done:
            sched.finish(seq)
            self.host.pop(seq.request_id, None)

    def _idle(self, arrivals: list[Sequence], split: TimeSplit) -> None:
        """Nothing to compute: start the next planned reload early and wait for the link, or for an arrival."""
        sched, _, link, _, _, _ = self._state
        t = time.perf_counter()
        inflight = [s.reload for s in sched.running if s.reload is not None and not s.reload.done]
        if link is not None and not inflight:
            waiting = sorted(
                (s for s in sched.running if s.reload is None),
                key=lambda s: (s.verify_step is None, s.verify_step or 0),
            )
            for seq in waiting[:1]:  # nothing else can run: the smallest ring (admission kept room for it)
                self._start_reload(seq, ring=2)
            inflight = [s.reload for s in sched.running if s.reload is not None and not s.reload.done]
        if inflight:
            inflight[0].layer_ready[-1].wait(0.5)
            split.link_wait_s += time.perf_counter() - t
            return
        if arrivals:
            delay = arrivals[0].request.arrival_s - (time.perf_counter() - self.t0)
            if delay > 0:
                time.sleep(min(delay, 0.5))
        else:  # nothing running can move, nothing in flight, nothing to arrive: the scheduler is stuck
            self._stalled_s += time.perf_counter() - t + 0.001
            time.sleep(0.001)
            if self._stalled_s > STALL_LIMIT_S:
                state = [(s.request_id, s.phase.value, len(s.drafts), s.horizon, s.verify_step) for s in sched.running]
                raise RuntimeError(
                    f"serving is stuck (a scheduler bug): rows {state}, waiting "
                    f"{[s.request_id for s in sched.waiting]}, {sched.blocks.resident} of "
                    f"{sched.blocks.budget} bytes in use"
                )
        split.idle_s += time.perf_counter() - t


class _Ready:
    """A reload that needs no waiting (its KV was recomputed in place)."""

    done = prefetched = True
    error = None

    def wait_layer(self, layer: int) -> float:
        return 0.0

    def consume(self, layer: int) -> None:
        return None
