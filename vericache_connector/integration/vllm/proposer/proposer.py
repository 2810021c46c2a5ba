"""Compressed-first drafting inside vLLM: a speculative proposer that drafts on the compressed KV copy with the
served model's own modules, and proposes only what pays.

    --speculative-config '{"method": "custom_class", "num_speculative_tokens": 32,
                           "model": "vericache_connector.vllm_proposer.CompressedKVProposer"}'

vLLM calls `propose` after every step with each running request's tokens; what it returns goes through
vLLM's own target forward and rejection sampler, so vLLM's output is what it is without drafts (greedy:
token for token; sampling: the target distribution). The proposer only decides which drafts to offer:

1. PRE-DRAFTS. On a store hit the connector (worker.py) fetches the small compressed copy first and posts it
   on the DraftHandoff while the full copy streams into vLLM's blocks. A pre-draft thread drafts the
   request's continuation on it (its suffix first, then token by token) until the full copy lands, in
   draft steps that never overlap vLLM's forward and yield to it (pacing.TargetGate): when vLLM is busy
   with other requests the pre-draft waits. Where the draft model hesitates the pre-draft branches
   (chains.py), so that a rejected draft often leaves another line of drafts ready. When the request's
   first token is sampled, the drafts made so far are verified: up to num_speculative_tokens per vLLM step
   (vLLM's bound on drafts per request and step), the rest in the following steps while vLLM accepts them.
   The compressed copy crosses the store link too (the full copy lands later by its transfer time): the
   connector fetches it only where the pre-drafts are expected to save more (DraftPacer.worth_predraft).
   With split16 (float32 KV) it costs nothing: the compressed copy is the upper half of every value's
   bits and the connector then fetches only the lower half (compressors/split16.py, worker.py).
2. N-GRAM matches (ngram.py: the drafts of vLLM's prompt-lookup method): free to make, proposed wherever the prompt or the
   output so far predicts a run, as vLLM's `ngram` method would (a longer one merged with the pre-drafts when
   they agree). Drafts already made are proposed as many as pay for their rows in the verify forward, at the
   acceptance measured for drafts of their kind (pre-drafts per request, n-gram drafts per match length).
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
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import OrderedDict

import numpy as np
import torch
from vllm.logger import init_logger

from ....compressors import CompressedKV
from ....draft import DraftConfig, make_draft_cache
from ..handoff import Deferred, DraftHandoff, find_handoff, materialize
from .chains import BRANCH_P, MAX_BRANCHES, Chain, Group, common
from .draft_model import DraftModel, UnsupportedModel
from .ngram import longest_ngram
from .pacing import BatchSwitch, DraftPacer, TargetGate, new_estimate
from .rows import RowTracker

logger = init_logger("vllm.vericache")  # under vLLM's logging config, so its lines show in the server log

MAX_GROUPS = 64  # requests with draft state (least recently used dropped)
MAX_DRAFT_BYTES = 1 << 30  # draft caches of all requests together
PREDRAFT_MAX = 256  # a chain's pre-draft stops here even if the full copy has not landed
CACHE_ROOM = 512  # draft-cache entries past the prompt (pre-drafts and later drafts); then drafting stops
NGRAM = (2, 4)  # prompt-lookup n-gram sizes (vLLM's ngram method: prompt_lookup_min / _max)
DRAFT_WEIGHTS_ENV = "VERICACHE_DRAFT_WEIGHTS"
LOG_EVERY = 200  # a stats line every this many proposals


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
        self.draft: DraftModel | None = None
        self.draft_cfg = DraftConfig(weights=draft_weights())  # layout of the draft caches, weights of the drafts
        self.gate, self.pacer = TargetGate(), DraftPacer(self.k)
        self.groups: OrderedDict[int, Group] = OrderedDict()
        # acceptance of n-gram drafts by the length of the match behind them, all requests (_ngram)
        self.ngram_est = {n: new_estimate() for n in range(self.ngram[0], self.ngram[1] + 1)}
        self._ngram_last: dict[int, tuple[int, list[int], int]] = {}  # batch index -> last step's n-gram drafts
        self.rows = RowTracker()  # which request each row is, step to step (rows.py)
        self.switch = BatchSwitch()
        self._step_end: tuple[int, bool, float] | None = None  # the last propose: (batch tokens, drafted, end)
        self._batch = 0  # running requests at the last propose
        self._switch_said: dict[int, bool | None] = {}  # batch bucket -> what the switch last measured
        self._next_id = 0
        self._lock = threading.Lock()  # groups and their chains, shared with the pre-draft thread
        self._building: set[tuple[int, int]] = set()  # (prefix length, hash) of draft caches being built
        self._sighted: OrderedDict[tuple[int, int], bool] = OrderedDict()  # matched once: built at the next step
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.handoff: DraftHandoff | None = None
        self.stats = dict(
            proposals=0,
            predrafts=0,
            predrafted=0,
            branches=0,
            predrafts_used=0,
            ngram=0,
            drafted=0,
            paced_off=0,
            seeded=0,
            switched_off=0,
        )
        self.accepted = dict.fromkeys(("predraft", "compressed", "ngram"), 0)  # tokens vLLM accepted (stats.py)

    attached = True  # the handoff's pacing object (handoff.Pacing) is this proposer

    @property
    def pacing(self) -> "CompressedKVProposer":
        return self

    def _find_handoff(self) -> DraftHandoff | None:
        """The connector's DraftHandoff, looked up until found (the connector is built after us)."""
        if self.handoff is None:
            self.handoff = find_handoff()
            if self.handoff is not None:
                self.handoff.attach(self)
        return self.handoff

    def load_model(self, target=None, *args, **kwargs) -> None:
        """vLLM hands over its model: the draft forward runs its modules, gated against its forward."""
        if self.draft is None and target is not None:
            try:
                self.draft = self._draft_model(target)
            except (UnsupportedModel, ValueError) as e:
                logger.warning("VeriCache proposer: no compressed-KV drafts for this model (%s); n-gram only", e)
            else:
                target.forward = self.gate.wrap(target.forward)
                self.pacer = DraftPacer(self.k, self.draft.device.type)
                per_token = self.draft.cfg.kv_bytes_per_token(2)  # paged float16 draft caches on the CPU
                copy = getattr(self.draft.layers, "copy_bytes", 0)
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
        self._find_handoff()

    def _draft_model(self, target) -> DraftModel:
        """The draft forward over vLLM's modules; VERICACHE_DRAFT_WEIGHTS=bfloat16 gives it a bfloat16 copy of
        the linear layers (its size logged), or the model's own where that copy cannot be made."""
        if self.draft_cfg.weights == "bfloat16":
            try:
                draft = DraftModel.of_vllm(target, self.hf_config, "bfloat16")
            except UnsupportedModel as e:
                logger.warning("VeriCache proposer: drafting with the model's own weights (%s)", e)
            else:
                return draft
        return DraftModel.of_vllm(target, self.hf_config)

    # ---- pre-drafts (the connector's worker asks, then posts; our thread drafts) ------------------------
    def worth_predraft(self, compressed_s: float | None, max_new: int | None) -> bool:
        """The connector asks before it fetches a compressed copy for a pre-draft (pacing.worth_predraft)."""
        return self.draft is not None and self.pacer.worth_predraft(compressed_s, max_new)

    def predraft_value(self) -> float | None:
        """Decode seconds pre-drafts saved per second of pre-drafting (what a second of load is worth to the
        connector's load-or-recompute decision); None until measured."""
        return None if self.draft is None else self.pacer.predraft_value()

    def drafts_could_pay(self, batch: int | None = None) -> bool:
        """Could a compressed-KV draft made after the load pay at this batch size (default: the batch of the
        last step)? The pacer's horizon at the prior acceptance. A draft cache (the compressed prefix decoded,
        tens of MB, on the cores vLLM's steps need) is built, and a compressed copy fetched for a recomputed
        prefix (the connector asks), only then; pre-drafts during a load do not ask (they use idle time)."""
        batch = self._batch if batch is None else batch
        return self.draft is not None and self.pacer.horizon(new_estimate(), self.k, max(1, batch)) > 0

    def worth_predraft_during(self, seconds: float) -> bool:
        """split16's load asks, once the upper halves are in: is the rest's transfer long enough to draft in?"""
        return self.draft is not None and self.pacer.worth_predraft_during(seconds)

    def predraft(
        self, prompt: list[int], prefix_len: int, compressed: CompressedKV, loaded: threading.Event | None
    ) -> None:
        """Draft the prompt's continuation on its compressed copy until `loaded` is set."""
        if self.draft is None or (loaded is not None and loaded.is_set()):
            return  # the full copy is in already: vLLM's own steps come next, a pre-draft would only delay them
        key = draft_key(prompt, prefix_len)
        with self._lock:
            if key in self._building:
                return
            self._building.add(key)  # (the request may run before the draft cache is built: _match waits)
        chain = self._build(key, prompt, prefix_len, compressed)
        if chain is None or (loaded is not None and loaded.is_set()):
            return  # built too late to pre-draft (a busy CPU): the draft cache stays for drafts after the load
        with self._lock:
            chain.group.prompt_len, chain.group.loaded = len(prompt), loaded
            chain.group.predraft_t0 = time.perf_counter()
            chain.tokens, chain.predrafting = list(prompt), True
            self.stats["predrafts"] += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._predraft_loop, name="vericache-predraft", daemon=True)
                self._thread.start()
        self._wake.set()

    def _predraft_loop(self) -> None:
        while True:
            self._wake.wait()
            jobs = self._predraft_jobs()
            if not jobs:
                self._wake.clear()
                continue
            if self.gate.target_busy():  # vLLM is serving other requests: their steps go first
                time.sleep(0.005)
                continue
            try:
                with self.gate.draft():
                    jobs = self._predraft_jobs()
                    if jobs:
                        self._step(jobs, branch=True)
            except Exception as e:  # noqa: BLE001 - drafts are optional; vLLM decodes without them
                logger.warning("VeriCache pre-draft failed (%s: %s); no pre-drafts", type(e).__name__, e)
                with self._lock:
                    for c in jobs:
                        c.predrafting = False

    def _predraft_jobs(self) -> list[Chain]:
        """Chains still pre-drafting: their full copy not in yet, below PREDRAFT_MAX, room left."""
        with self._lock:
            for g in self.groups.values():
                going = [c for c in g.chains if c.predrafting]
                if not going:
                    continue
                if g.loaded is None or g.loaded.is_set():
                    for c in going:
                        c.predrafting = False
                    g.predraft_s = time.perf_counter() - g.predraft_t0
                    made = [len(c.tokens) - g.prompt_len for c in g.chains]
                    logger.info(
                        "VeriCache pre-draft: %d tokens drafted on the compressed copy of a %d-token prefix, in %d "
                        "chains (%s)",
                        sum(made),
                        g.prefix_len,
                        len(made),
                        ", ".join(map(str, made)),
                    )
                for c in going:
                    if len(c.tokens) - g.prompt_len >= PREDRAFT_MAX or not c.room:
                        c.predrafting = False
            return [c for g in self.groups.values() for c in g.chains if c.predrafting]

    def _step(self, chains: list[Chain], branch: bool = False) -> None:
        """One batched draft step: each chain feeds what its cache lacks and gets one greedy draft token; a
        pre-draft (branch=True) remembers the second choice as a branch point and grows the likeliest one."""
        feeds = [c.tokens[c.in_cache :] for c in chains]
        t0 = time.perf_counter()
        logits = self.draft.forward(feeds, [c.in_cache for c in chains], [c.cache for c in chains])
        top_p, top = torch.log_softmax(logits, -1).topk(2, dim=-1)
        if max(len(f) for f in feeds) == 1:  # a plain draft step (not a suffix or catch-up feed)
            self.pacer.drafted(time.perf_counter() - t0)
        groups = []
        with self._lock:
            for c, (t1, t2), (lp1, lp2) in zip(chains, top.tolist(), top_p.tolist()):
                c.in_cache = len(c.tokens)
                if branch and c.predrafting:
                    c.group.add_candidate(c.logp + lp2, c, len(c.tokens), int(t2))
                    groups.append(c.group)
                c.tokens.append(int(t1))
                c.logp += lp1
                self.stats["predrafted" if c.predrafting else "drafted"] += 1
        for g in {id(g): g for g in groups}.values():  # outside the lock: copying a cache takes a while
            while (got := g.next_branch(math.log(BRANCH_P))) is not None:
                logp, source, at, token = got
                other = source.branch(at, token, logp)
                with self._lock:
                    g.chains.append(other)
                    self.stats["branches"] += 1

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
        self.pacer.propose_started(prefill=prefill)
        total = sum(len(r) for r in rows.values())  # the batch's tokens: what the step emitted, next step
        self._measure_step(self.rows.same_batch(was) and not prefill, len(rows), total)
        ngram_last, self._ngram_last = self._ngram_last, {}
        self._batch = batch = len(rows)
        allowed = self.switch.allows(batch)  # measured: do drafts raise the output at this batch size?
        self._log_switch(batch)
        self._find_handoff()
        out: list[list[int]] = [[] for _ in sampled_token_ids]
        present, to_draft = set(), []
        for i, row_np in rows.items():
            n = len(row_np)
            room = min(self.k, self.max_len - n - 1)
            if room < 1:
                continue
            row = row_np.tolist()
            if self.handoff is not None and self.handoff.seeded(row):  # sampled with a seed: none (handoff.py)
                self.stats["seeded"] += 1
                continue
            self._account_ngram(row, ngram_last.get(was[i]))
            group = self._match(row, present, build=allowed)
            if not allowed:  # no drafts this step: the request's draft state is kept, nothing is built or made
                if group is not None:
                    present.add(id(group))
                    group.claimed = True
                    self._account(group, row)
                    for chain in group.chains:
                        chain.predrafting = False
                self.stats["switched_off"] += 1
                continue
            n_gram, gram = self._ngram(row_np, room)
            if group is not None:
                present.add(id(group))
                group.claimed = True
                self._account(group, row)
                chain, m = group.best(row)
                with self._lock:
                    chain.predrafting = False  # the request is running: its pre-drafts stop where they are
                    ahead = chain.tokens[m : m + room] if m == len(row) else []
                    group.prune(row, chain)
                if ahead:
                    ahead = ahead[: self.pacer.free_horizon(group.estimate, len(ahead), batch)]
                    longer = bool(ahead) and len(gram) > len(ahead) and gram[: len(ahead)] == ahead
                    out[i] = gram if longer else ahead
                    group.proposed = (len(row), list(out[i]), "predraft")
                    self.stats["predrafts_used"] += 1
                    continue
            if gram:
                out[i] = gram[: self.pacer.free_horizon(self.ngram_est[n_gram], len(gram), batch)]
                self._ngram_last[i] = (len(row), list(out[i]), n_gram)
                self.stats["ngram"] += 1
                continue
            if group is not None and self.draft is not None:
                chain = group.chains[0]
                x = min(self.pacer.horizon(group.estimate, room, batch), group.capacity - (len(row) - group.prefix_len))
                if x > 0:
                    to_draft.append((i, chain, row, x))
                else:
                    self.stats["paced_off"] += 1
        if to_draft:
            self._draft_rows(to_draft, out)
        self._finish_absent(present)
        self.stats["proposals"] += 1
        if self.stats["proposals"] % LOG_EVERY == 0:
            logger.info("VeriCache proposer: %s, %s; %s", self.stats, self.pacer.describe(), self.switch.describe())
        self.pacer.propose_ended(sum(len(o) for o in out), rows=batch)
        self._step_end = (total, any(out), time.perf_counter())
        return out

    def _log_switch(self, batch: int) -> None:
        """An INFO line whenever the batch switch's measured verdict for a batch bucket changes."""
        bucket, pays = self.switch.bucket(batch), self.switch.pays(batch)
        if self._switch_said.get(bucket) != pays:
            self._switch_said[bucket] = pays
            if pays is not None:
                logger.info(
                    "VeriCache proposer: drafts %s at batch %d; %s",
                    "on" if pays else "off",
                    batch,
                    self.switch.describe(),
                )

    def _measure_step(self, same_batch: bool, batch: int, total: int) -> None:
        """The step vLLM just ran: the tokens it emitted (the rows' growth) over its seconds, with or without
        drafts, for the batch switch; left out where the batch changed (a new request's prefill ran)."""
        if self._step_end is not None and same_batch:
            last_total, drafted, end = self._step_end
            self.switch.record(batch, drafted, total - last_total, time.perf_counter() - end)
        self._step_end = None

    def _account(self, group: Group, row: list[int]) -> None:
        """Acceptance of the compressed drafts proposed last step: how far the row followed them."""
        if group.proposed is None:
            return
        at, drafts, source = group.proposed
        group.proposed = None
        if len(row) > at:  # the step ran: n of the drafts accepted
            n = common(drafts, row[at:], 0)
            group.estimate.update(n, len(drafts))
            self.accepted[source] += n
            if source == "predraft":
                group.predraft_accepted += n

    def _account_ngram(self, row: list[int], got: tuple[int, list[int], int] | None) -> None:
        """Acceptance of the n-gram drafts proposed for this request last step (got: where, what, and the
        length of the match behind them)."""
        if got is not None and len(row) > got[0]:
            at, drafts, n_gram = got
            n = common(drafts, row[at:], 0)
            self.ngram_est[n_gram].update(n, len(drafts))
            self.accepted["ngram"] += n

    def _draft_rows(self, rows: list[tuple[int, Chain, list[int], int]], out: list[list[int]]) -> None:
        """x_r compressed-KV drafts for each row, all rows in one forward per draft step."""
        with self.gate.draft():
            with self._lock:
                for _, chain, row, _ in rows:  # roll back to what the row still shares
                    chain.rollback(row)
            for step in range(max(x for *_, x in rows)):
                self._step([chain for _, chain, _, x in rows if step < x])
        for i, chain, row, x in rows:
            out[i] = chain.tokens[len(row) : len(row) + x]
            chain.group.proposed = (len(row), list(out[i]), "compressed")

    def _ngram(self, row: np.ndarray, room: int) -> tuple[int, list[int]]:
        """(n, drafts) of longest_ngram: each match length has its own acceptance estimate."""
        return longest_ngram(row.astype(np.int32), *self.ngram, self.max_len, room)

    # ---- draft states -----------------------------------------------------------------------------------
    def _match(self, row: list[int], present: set[int], build: bool = True) -> Group | None:
        """The group of the request this row is (its stored prefix and chains), or (build) a new one from a
        compressed copy the connector posted."""
        with self._lock:
            for g in self.groups.values():
                if id(g) not in present and g.prefix_len < len(row):
                    if hash(tuple(row[: g.prefix_len])) == g.prefix_hash:
                        self.groups.move_to_end(next(k for k, v in self.groups.items() if v is g))
                        return g
        handoff = self.handoff
        found = None if handoff is None or self.draft is None else handoff.find(row)
        if found is None:
            return None
        # A copy posted without a pre-draft (a fast load): its draft cache is built on a thread of its own,
        # not in this call, which vLLM's step waits for; and from the request's second step on, so that the
        # build (and the cut of a Deferred copy) does not take the cores while its first token goes out; and
        # only at a step that may draft (build) at a batch size where its compressed drafts could pay.
        key = draft_key(row, found[0])
        with self._lock:
            if key in self._building:
                return None
            if key not in self._sighted:
                self._sighted[key] = True
                while len(self._sighted) > MAX_GROUPS:
                    self._sighted.popitem(last=False)
                return None
            if not (build and self.drafts_could_pay()):
                return None
            del self._sighted[key]
            self._building.add(key)

        threading.Thread(target=self._build, args=(key, row, *found), name="vericache-draft-cache", daemon=True).start()
        return None

    def _build(self, key, tokens: list[int], prefix_len: int, compressed: CompressedKV | Deferred) -> Chain | None:
        """_new_group for a draft cache its caller registered in _building (key), released however it ends."""
        try:
            return self._new_group(tokens, prefix_len, compressed)
        finally:
            with self._lock:
                self._building.discard(key)

    def _new_group(self, tokens: list[int], prefix_len: int, compressed: CompressedKV | Deferred) -> Chain | None:
        room = min(self.max_len - prefix_len, len(tokens) - prefix_len + CACHE_ROOM)
        try:
            cache = make_draft_cache(self.draft, [materialize(compressed)], room, self.draft_cfg)
        except Exception as e:  # noqa: BLE001 - a copy that does not fit: no drafts for it
            logger.warning("VeriCache proposer: compressed copy unusable (%s: %s)", type(e).__name__, e)
            return None
        kept = int(cache.lengths[0])
        nbytes = (kept + room) * self.draft.cfg.kv_bytes_per_token(2)
        g = Group(prefix_len, hash(tuple(tokens[:prefix_len])), kept, room, nbytes, new_estimate())
        chain = Chain(g, cache, list(tokens[:prefix_len]), prefix_len)
        g.chains.append(chain)
        with self._lock:
            self.groups[self._next_id] = g
            self._next_id += 1
            while len(self.groups) > MAX_GROUPS or sum(x.nbytes for x in self.groups.values()) > MAX_DRAFT_BYTES:
                oldest = next(iter(self.groups))
                if self.groups[oldest] is g:
                    break
                self._drop(oldest)
        return chain

    def _finish_absent(self, present: set[int]) -> None:
        """A claimed group missing from this step has finished (or was preempted): drop it."""
        with self._lock:
            for key in [k for k, g in self.groups.items() if g.claimed and id(g) not in present]:
                self._drop(key)

    def _drop(self, key: int) -> None:
        g = self.groups.pop(key)
        if g.prompt_len:  # it had pre-drafts: what they saved is what the next fetch decision weighs
            self.pacer.predraft_yield(g.predraft_accepted, g.predraft_s)
            logger.info(
                "VeriCache proposer: request done, vLLM accepted %d pre-drafted tokens; %s; %s",
                g.predraft_accepted,
                self.stats,
                self.pacer.describe(),
            )


def draft_key(tokens: list[int], n: int) -> tuple[int, int]:
    """(n, hash of the first n tokens): a draft cache's prefix, as _building and _sighted know it."""
    return n, hash(tuple(tokens[:n]))


def draft_weights(env=None) -> str:
    """VERICACHE_DRAFT_WEIGHTS: "model" (default: vLLM's own modules, no second copy of the weights) or
    "bfloat16" (a bfloat16 copy of the linear layers for a float32 model on the CPU: faster draft steps for
    half the weights' bytes more memory). ValueError naming any other value."""
    value = (os.environ if env is None else env).get(DRAFT_WEIGHTS_ENV, "model").strip() or "model"
    if value not in ("model", "bfloat16"):
        raise ValueError(f"{DRAFT_WEIGHTS_ENV} must be 'model' or 'bfloat16', got {value!r}")
    return value
