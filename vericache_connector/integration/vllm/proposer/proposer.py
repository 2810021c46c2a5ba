"""Compressed-first drafting inside vLLM: a speculative proposer that drafts on the compressed KV copy with the
served model's own modules, and proposes only what pays.

    --speculative-config '{"method": "custom_class", "num_speculative_tokens": 32,
                           "model": "vericache_connector.vllm_proposer.CompressedKVProposer"}'

vLLM calls `propose` after every step with each running request's tokens; what it returns goes through
vLLM's own target forward and rejection sampler, so vLLM's output is what it is without drafts (greedy:
token for token; sampling: the target distribution). The proposer only decides which drafts to offer:

1. PRE-DRAFTS. On a store hit the connector (worker.py) fetches the small compressed copy first and posts it
   on the DraftHandoff while the full copy streams into vLLM's blocks. A pre-draft thread (predraft.py) drafts
   the request's continuation on it (its suffix first, then token by token) until the full copy lands, in
   draft steps that never overlap vLLM's forward and yield to it (pacing.TargetGate): when vLLM is busy with
   other requests the pre-draft waits. Where the draft model hesitates the pre-draft branches (chains.py), so
   that a rejected draft often leaves another line of drafts ready. When the request's first token is sampled,
   the drafts made so far are verified: up to num_speculative_tokens per vLLM step (vLLM's bound on drafts per
   request and step), the rest in the following steps while vLLM accepts them. The compressed copy crosses the
   store link too (the full copy lands later by its transfer time): the connector fetches it only where the
   pre-drafts are expected to save more (DraftPacer.worth_predraft). With split16 (float32 KV) it costs
   nothing: the compressed copy is the upper half of every value's bits and the connector then fetches only
   the lower half (compressors/split16.py, worker.py).
2. N-GRAM matches (ngram.py: the drafts of vLLM's prompt-lookup method): free to make, proposed wherever the
   prompt or the output so far predicts a run, as vLLM's `ngram` method would (a longer one merged with the
   pre-drafts when they agree). Drafts already made are proposed as many as pay for their rows in the verify
   forward, at the acceptance measured for drafts of their kind (pre-drafts per request, n-gram drafts per
   match length).
3. COMPRESSED-KV drafts after that, batched across requests (draft_model.py: one forward for all), only
   while DraftPacer predicts they shorten the request from measured draft and vLLM step times and each
   request's acceptance; otherwise nothing, so the proposer is never slower than the connector alone by
   more than its bookkeeping.

No second copy of the weights: vLLM passes its model to load_model and the draft forward calls its modules
(on the CPU vLLM has packed each linear layer into a oneDNN handle; the draft step calls the same handle).
Opt-in, VERICACHE_DRAFT_WEIGHTS=bfloat16 on a float32 CPU server: the draft forward runs a bfloat16 copy of
the linear layers (half their bytes in memory, half the bytes each draft step reads; draft_model.Bf16Linear).
What the proposer adds in memory is the draft caches (compressed prefix + the tokens after it, in the
draft/ package's layout: paged float16 on the CPU), bounded by MAX_DRAFT_BYTES and logged at start.

This class is vLLM's side only: load_model, and propose's loop (match each row to its request's draft state,
choose its pre-drafts, an n-gram match or compressed-KV drafts, draft the batch). Its collaborators: the
draft caches and the batched draft step (draft_caches.py), the pre-draft thread (predraft.py), what vLLM
accepted and what its steps took (measure.py), when drafting pays (pacing.py: DraftPacer, BatchSwitch, and
ProposerPacing, the object the connector's worker asks through the handoff). connector/stats.py reads the
proposer's `stats` and `accepted`.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import torch
from vllm.logger import init_logger

from ....compressors import CompressedKV
from ....draft import DraftConfig
from ..handoff import DraftHandoff, find_handoff
from .chains import MAX_BRANCHES, Chain
from .config import ProposerConfig
from .draft_caches import CACHE_ROOM, MAX_DRAFT_BYTES, MAX_GROUPS, DraftCaches
from .draft_model import DraftModel, UnsupportedModel
from .handoff_pacing import ProposerPacing
from .measure import Acceptance, StepMeter, new_stats
from .ngram import longest_ngram
from .pacing import BatchSwitch, DraftPacer, TargetGate
from .predraft import Predrafter
from .rows import RowTracker
from .runner_state import RunnerState, UnsupportedRunner
from .view_draft import ViewDrafter
from .view_pacing import ViewPacer, ViewRows

logger = init_logger("vllm.vericache")  # under vLLM's logging config, so its lines show in the server log

NGRAM = (2, 4)  # prompt-lookup n-gram sizes (vLLM's ngram method: prompt_lookup_min / _max)
DRAFT_WEIGHTS_ENV = "VERICACHE_DRAFT_WEIGHTS"
LOG_EVERY, LOG_EVERY_S = 200, 15.0  # a stats line every this many proposals, or seconds


class CompressedKVProposer:
    """vLLM custom_class proposer: pre-drafts, n-gram matches, paced compressed-KV drafts (module docstring)."""

    def __init__(self, vllm_config):
        spec, mc = vllm_config.speculative_config, vllm_config.model_config
        self.k = int(spec.num_speculative_tokens)
        self.max_len = int(mc.max_model_len)
        hf = getattr(mc, "hf_config", None)
        self.hf_config = hf.to_dict() if hasattr(hf, "to_dict") else dict(hf or {})
        lo, hi = getattr(spec, "prompt_lookup_min", None), getattr(spec, "prompt_lookup_max", None)
        self.ngram = (lo or NGRAM[0], hi or NGRAM[1])
        self.config = ProposerConfig.from_env()  # which drafts it offers (VERICACHE_DRAFTS, VERICACHE_DRAFT_VIEW)
        self.stats = new_stats()
        self.gate, self.pacer, self.switch = TargetGate(), DraftPacer(self.k), BatchSwitch()
        # the draft model (load_model) and each request's draft caches; their layout, the drafts' weights
        self.caches = DraftCaches(self.max_len, DraftConfig(weights=draft_weights()), self.pacer, self.stats)
        self.predrafter = Predrafter(self.caches, self.gate, self.stats)
        self.pacing = ProposerPacing(self.pacer, self.caches, self.config)  # what the connector asks (handoff.py)
        self.acceptance = Acceptance(self.ngram)
        self.meter = StepMeter(self.pacer, self.switch)
        self.rows = RowTracker()  # which request each row is, step to step (rows.py)
        self.handoff: DraftHandoff | None = None
        # self-drafts on a view of each request's own KV (view_draft.py): vLLM's runner (found in load_model),
        # the drafter (built once vLLM has allocated its KV cache), their pacing and per-request acceptance
        self.runner: RunnerState | None = None
        self.view: ViewDrafter | None = None
        self.view_pacer, self.view_rows = ViewPacer(self.pacer), ViewRows()
        self._logged = time.monotonic()  # the last stats line

    @property
    def accepted(self) -> dict[str, int]:
        """Tokens vLLM accepted, by source (connector/stats.py reads it with `stats`)."""
        return self.acceptance.accepted

    def _find_handoff(self) -> DraftHandoff | None:
        """The connector's DraftHandoff, looked up until found (the connector is built after us)."""
        if self.handoff is None:
            self.handoff = find_handoff()
            if self.handoff is not None:
                self.handoff.attach(self)
        return self.handoff

    def load_model(self, target=None, *args, **kwargs) -> None:
        """vLLM hands over its model: the draft forward runs its modules, gated against its forward. With
        self-drafting on, the runner that calls this is found for its KV cache and block table."""
        if not self.config.uses_compressed_copy:
            logger.info("VeriCache proposer: n-gram matches only (%s)", ", ".join(sorted(self.config.sources)))
        elif self.caches.draft is None and target is not None:
            try:
                draft = self._draft_model(target)
            except (UnsupportedModel, ValueError) as e:
                logger.warning("VeriCache proposer: no compressed-KV drafts for this model (%s); n-gram only", e)
            else:
                self.caches.draft = draft
                target.forward = self.gate.wrap(target.forward)
                self.pacer.on_device(draft.device.type)
                per_token = draft.cfg.kv_bytes_per_token(2)  # paged float16 draft caches on the CPU
                copy = getattr(draft.layers, "copy_bytes", 0)
                logger.info(
                    "VeriCache proposer: drafts with %s; "
                    "draft caches hold each drafting request's compressed prefix + %d tokens, %d bytes per "
                    "entry, up to %d per request (pre-draft branches), at most %d MiB in all (%d requests); "
                    "k=%d, n-gram %d-%d",
                    f"a bfloat16 copy of the served model's linear layers ({copy >> 20} MiB)"
                    if copy
                    else "the served model's own modules (no copy of its weights)",
                    CACHE_ROOM,
                    per_token,
                    MAX_BRANCHES,
                    MAX_DRAFT_BYTES >> 20,
                    MAX_GROUPS,
                    self.k,
                    *self.ngram,
                )
                if "compressed" in self.config.sources and self.config.view is not None:
                    try:
                        self.runner = RunnerState.of_caller()  # here: the caller's frame is the runner's
                    except UnsupportedRunner as e:
                        logger.warning("VeriCache proposer: no self-drafting on views of the KV (%s)", e)
                    if self.runner is not None:
                        self.caches.view_drafting = True  # no store-copy draft cache is built after a load
                        logger.info(
                            "VeriCache proposer: self-drafts on views of each request's KV: %s", self.config.view
                        )
        self._find_handoff()

    def _draft_model(self, target) -> DraftModel:
        """The draft forward over vLLM's modules; VERICACHE_DRAFT_WEIGHTS=bfloat16 gives it a bfloat16 copy of
        the linear layers (its size logged), or the model's own where that copy cannot be made."""
        if self.caches.cfg.weights == "bfloat16":
            try:
                draft = DraftModel.of_vllm(target, self.hf_config, "bfloat16")
            except UnsupportedModel as e:
                logger.warning("VeriCache proposer: drafting with the model's own weights (%s)", e)
            else:
                return draft
        return DraftModel.of_vllm(target, self.hf_config)

    def predraft(
        self, prompt: list[int], prefix_len: int, compressed: CompressedKV, loaded: threading.Event | None
    ) -> None:
        """The connector's worker posted a compressed copy to pre-draft on until `loaded` is set (predraft.py)."""
        self.predrafter.predraft(prompt, prefix_len, compressed, loaded)

    # ---- called by vLLM after every step ----------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **kwargs):
        rows = {}  # running requests: their token rows (what this step's batch is)
        for i, sampled in enumerate(sampled_token_ids):
            if len(sampled):
                rows[i] = np.asarray(token_ids_cpu[i, : int(num_tokens_no_spec[i])])
        was = self.rows.match(rows)  # batch index -> the request's index at the last propose (None: new)
        # A prefill ran in the step too: a new request's (its prompt's last chunk), or a chunk of a prompt still
        # being computed (its row sampled nothing). Its time is a prefill's: an outlier for the step costs.
        prefill = any(p is None for p in was.values()) or len(rows) < len(sampled_token_ids)
        total = sum(len(r) for r in rows.values())  # the batch's tokens: what the step emitted, next step
        self.meter.started(prefill, self.rows.same_batch(was) and not prefill, len(rows), total)
        ngram_last = self.acceptance.new_step()
        self.pacing.batch = batch = len(rows)
        allowed = self.meter.allows(batch)  # measured: do drafts raise the output at this batch size?
        self._find_handoff()
        view = self._view()
        sources = self.config.sources
        out: list[list[int]] = [[] for _ in sampled_token_ids]
        present, to_draft, to_view, running = set(), [], [], set()
        for i, row_np in rows.items():
            room = min(self.k, self.max_len - len(row_np) - 1)
            if room < 1:
                continue
            row = row_np.tolist()
            if self.handoff is not None and self.handoff.seeded(row):  # sampled with a seed: none (handoff.py)
                self.stats["seeded"] += 1
                continue
            self.acceptance.ngram(row, ngram_last.get(was[i]))
            rid = self.runner.req_id(i) if view is not None else None
            if rid is not None:  # how far vLLM followed this request's view drafts of the last step
                running.add(rid)
                self.acceptance.accepted["compressed"] += self.view_rows.account(rid, row)
            group = self.caches.match(row, present, self.handoff, allowed, self.pacing.drafts_could_pay)
            if group is not None:  # the request's draft state: how far vLLM followed its last proposal
                present.add(id(group))
                group.claimed = True
                self.acceptance.group(group, row)
            if not allowed:  # no drafts this step: the request's draft state is kept, nothing is built or made
                for chain in group.chains if group is not None else ():
                    chain.predrafting = False
                self.stats["switched_off"] += 1
                continue
            n, gram = longest_ngram(row_np, *self.ngram, self.max_len, room) if "ngram" in sources else (0, [])
            if group is not None and (ahead := self.caches.made(group, row, room)):  # pre-drafts
                ahead = ahead[: self.pacer.free_horizon(group.estimate, len(ahead), batch)]
                longer = bool(ahead) and len(gram) > len(ahead) and gram[: len(ahead)] == ahead
                out[i] = gram if longer else ahead
                group.proposed = (len(row), list(out[i]), "predraft")
                self.stats["predrafts_used"] += 1
            elif gram:  # an n-gram match
                out[i] = gram[: self.pacer.free_horizon(self.acceptance.ngram_est[n], len(gram), batch)]
                self.acceptance.ngram_last[i] = (len(row), list(out[i]), n)
                self.stats["ngram"] += 1
            elif rid is not None:  # self-drafts on a view of the request's own KV: sized together below
                if view.small_enough(len(row)):
                    to_view.append((i, row, min(room, view.room(i, len(row))), rid))
                else:  # the view would hold most of the row's KV: a draft step would cost about vLLM's step
                    self.stats["view_too_short"] += 1
            elif group is not None and self.caches.draft is not None and "compressed" in sources:  # if they pay
                x = min(self.pacer.horizon(group.estimate, room, batch), group.capacity - (len(row) - group.prefix_len))
                if x > 0:
                    to_draft.append((i, group.chains[0], row, x))
                else:
                    self.stats["paced_off"] += 1
        if to_draft:
            self._draft_rows(to_draft, out)
        if to_view:
            self._draft_views(to_view, batch, out)
        if view is not None:
            self.view_rows.keep(running)
        self.caches.finish_absent(present)
        self.stats["proposals"] += 1
        now = time.monotonic()
        if self.stats["proposals"] % LOG_EVERY == 0 or now - self._logged > LOG_EVERY_S:
            self._logged = now
            logger.info(
                "VeriCache proposer: %s, %s, %s; %s",
                self.stats,
                self.pacer.describe(),
                self.view_pacer.describe(),
                self.switch.describe(),
            )
        self.meter.ended(sum(len(o) for o in out), batch, total)
        return out

    def _view(self) -> ViewDrafter | None:
        """The view drafter, built at the first propose after vLLM allocated its KV cache (None: no self-drafts)."""
        if self.view is None and self.runner is not None and self.caches.draft is not None:
            try:
                self.runner.layers()  # allocated, and laid out as the drafter reads it
            except UnsupportedRunner as e:
                logger.warning("VeriCache proposer: no self-drafting on views of the KV (%s)", e)
                self.runner, self.caches.view_drafting = None, False
            else:
                self.view = ViewDrafter(self.caches.draft.layers, self.runner, self.config.view)
        return self.view

    def _draft_views(self, rows: list[tuple[int, list[int], int, str]], batch: int, out: list[list[int]]) -> None:
        """Self-drafts for the rows that had nothing else: one x for all of them (ViewPacer), each at most its room,
        in batched draft steps over each row's view (ViewDrafter)."""
        x = self.view_pacer.horizon([self.view_rows.estimate(rid).alpha for *_, rid in rows], self.k, batch)
        if x < 1:
            self.stats["paced_off"] += len(rows)
            return
        wanted = [(i, row, min(x, room)) for i, row, room, _ in rows if room > 0]
        if not wanted:
            return
        with self.gate.draft():
            drafts = self.view.draft(wanted)
        if self.view.step_s is not None:  # a draft step's seconds, the key bounds of new blocks left out
            self.view_pacer.drafted(self.view.step_s, len(wanted))
        by_index = {i: rid for i, _, _, rid in rows}
        for (i, row, _), made in zip(wanted, drafts):
            out[i] = made
            self.view_rows.proposed(by_index[i], len(row), made)
            self.stats["drafted"] += len(made)

    def _draft_rows(self, rows: list[tuple[int, Chain, list[int], int]], out: list[list[int]]) -> None:
        """x_r compressed-KV drafts for each row, all rows in one forward per draft step."""
        with self.gate.draft():
            with self.caches.lock:
                for _, chain, row, _ in rows:  # roll back to what the row still shares
                    chain.rollback(row)
            for step in range(max(x for *_, x in rows)):
                self.caches.step([chain for _, chain, _, x in rows if step < x])
        for i, chain, row, x in rows:
            out[i] = chain.tokens[len(row) : len(row) + x]
            chain.group.proposed = (len(row), list(out[i]), "compressed")


def draft_weights(env=None) -> str:
    """VERICACHE_DRAFT_WEIGHTS: "model" (default: vLLM's own modules, no second copy of the weights) or
    "bfloat16" (a bfloat16 copy of the linear layers for a float32 model on the CPU: faster draft steps for
    half the weights' bytes more memory). ValueError naming any other value."""
    value = (os.environ if env is None else env).get(DRAFT_WEIGHTS_ENV, "model").strip() or "model"
    if value not in ("model", "bfloat16"):
        raise ValueError(f"{DRAFT_WEIGHTS_ENV} must be 'model' or 'bfloat16', got {value!r}")
    return value
