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
   with other requests the pre-draft waits. When the request's first token is sampled, the drafts made so
   far are verified: up to num_speculative_tokens per vLLM step (vLLM's bound on drafts per request and
   step), the rest in the following steps while vLLM keeps accepting them.
2. N-GRAM matches (vLLM's own prompt-lookup matcher): free to make, proposed wherever the prompt or the
   output so far predicts a run, exactly as vLLM's `ngram` method would (a longer one merged with the
   pre-drafts when they agree).
3. COMPRESSED-KV drafts after that, batched across requests (draft_model.py: one forward for all), only
   while DraftPacer predicts they shorten the request from measured draft and vLLM step times and each
   request's acceptance; otherwise nothing, so the proposer is never slower than the connector alone by
   more than its bookkeeping.

No second copy of the weights: vLLM passes its model to load_model and the draft forward calls its modules
(on the CPU vLLM has packed each linear layer into a oneDNN handle; the draft step calls the same handle).
What the proposer adds in memory is the draft caches (compressed prefix + the tokens after it, in the
draft/ package's layout: paged float16 on the CPU), bounded by MAX_DRAFT_BYTES and logged at start.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch
from vllm.logger import init_logger

from ...compressors import CompressedKV
from ...draft import DraftConfig, make_draft_cache
from ...engine.planner import AcceptanceEstimate
from ...model.kv_cache import RowCache
from .draft_model import DraftModel, UnsupportedModel
from .handoff import DraftHandoff, find_handoff
from .pacing import DraftPacer, TargetGate, new_estimate

logger = init_logger("vllm.vericache")  # under vLLM's logging config, so its lines show in the server log

MAX_SEQS = 64  # draft states kept (least recently used dropped)
MAX_DRAFT_BYTES = 1 << 30  # draft caches of all requests together
PREDRAFT_MAX = 256  # a pre-draft stops here even if the full copy has not landed
CACHE_ROOM = 512  # draft-cache entries past the prompt (pre-drafts and later drafts); then drafting stops
NGRAM = (2, 4)  # prompt-lookup n-gram sizes (vLLM's ngram method: prompt_lookup_min / _max)
LOG_EVERY = 200  # a stats line every this many proposals


@dataclass
class _Seq:
    """One request's draft state. tokens = prompt + emitted + drafted; the cache holds the compressed prefix
    (`kept` entries for prefix_len tokens) and the KV of tokens[prefix_len:in_cache]."""

    prefix_len: int
    prefix_hash: int
    kept: int
    cache: RowCache
    capacity: int  # tokens the cache can hold past the prefix
    nbytes: int
    tokens: list[int]
    in_cache: int
    prompt_len: int = 0
    loaded: threading.Event | None = None  # set when the full copy is in (pre-draft until then)
    predrafting: bool = False
    claimed: bool = False  # by a row of vLLM's batch; a claimed state missing from a step has finished
    estimate: AcceptanceEstimate = field(default_factory=new_estimate)
    proposed: tuple[int, list[int]] | None = None  # (row length, compressed drafts) of the last proposal


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
        self.draft_cfg = DraftConfig()
        self.gate, self.pacer = TargetGate(), DraftPacer(self.k)
        self.seqs: OrderedDict[int, _Seq] = OrderedDict()
        self._next_id = 0
        self._lock = threading.Lock()  # seqs and their tokens, shared with the pre-draft thread
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.handoff: DraftHandoff | None = None
        self.stats = dict(proposals=0, predrafts=0, predrafted=0, predrafts_used=0, ngram=0, drafted=0, paced_off=0)

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
                self.draft = DraftModel.of_vllm(target, self.hf_config)
            except (UnsupportedModel, ValueError) as e:
                logger.warning("VeriCache proposer: no compressed-KV drafts for this model (%s); n-gram only", e)
            else:
                target.forward = self.gate.wrap(target.forward)
                mc = self.draft.cfg
                per_token = mc.kv_bytes_per_token(2)  # paged float16 draft caches on the CPU
                logger.info(
                    "VeriCache proposer: drafts with the served model's own modules (no copy of its weights); "
                    "draft caches hold each drafting request's compressed prefix + %d tokens, %d bytes per "
                    "entry, at most %d MiB in all (%d requests); k=%d, n-gram %d-%d",
                    CACHE_ROOM,
                    per_token,
                    MAX_DRAFT_BYTES >> 20,
                    MAX_SEQS,
                    self.k,
                    *self.ngram,
                )
        self._find_handoff()

    # ---- pre-drafts (the connector's worker thread posts; our thread drafts) --------------------------
    def predraft(
        self, prompt: list[int], prefix_len: int, compressed: CompressedKV, loaded: threading.Event | None
    ) -> None:
        """Draft the prompt's continuation on its compressed copy until `loaded` is set."""
        if self.draft is None or (loaded is not None and loaded.is_set()):
            return  # the full copy is in already: vLLM's own steps come next, a pre-draft would only delay them
        seq = self._new_seq(prompt, prefix_len, compressed)
        if seq is None:
            return
        with self._lock:
            seq.tokens, seq.prompt_len, seq.loaded = list(prompt), len(prompt), loaded
            seq.predrafting = True
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
                        self._step(jobs)
            except Exception as e:  # noqa: BLE001 - drafts are optional; vLLM decodes without them
                logger.warning("VeriCache pre-draft failed (%s: %s); no pre-drafts", type(e).__name__, e)
                with self._lock:
                    for s in jobs:
                        s.predrafting = False

    def _predraft_jobs(self) -> list[_Seq]:
        """Pre-drafts still to step: their full copy not in yet, below PREDRAFT_MAX, room left."""
        with self._lock:
            for s in self.seqs.values():
                if s.predrafting and (
                    (s.loaded is not None and s.loaded.is_set())
                    or len(s.tokens) - s.prompt_len >= PREDRAFT_MAX
                    or not self._room(s)
                ):
                    s.predrafting = False
                    logger.info(
                        "VeriCache pre-draft: %d tokens drafted on the compressed copy of a %d-token prefix",
                        len(s.tokens) - s.prompt_len,
                        s.prefix_len,
                    )
            return [s for s in self.seqs.values() if s.predrafting]

    def _step(self, seqs: list[_Seq]) -> None:
        """One batched draft step: each row feeds what its cache lacks and gets one greedy draft token."""
        feeds = [s.tokens[s.in_cache :] for s in seqs]
        t0 = time.perf_counter()
        logits = self.draft.forward(feeds, [s.in_cache for s in seqs], [s.cache for s in seqs])
        drafts = logits.argmax(-1).tolist()
        if max(len(f) for f in feeds) == 1:  # a plain draft step (not a suffix or catch-up feed)
            self.pacer.drafted(time.perf_counter() - t0)
        with self._lock:
            for s, d in zip(seqs, drafts):
                s.in_cache = len(s.tokens)
                s.tokens.append(int(d))
                self.stats["predrafted" if s.predrafting else "drafted"] += 1

    # ---- called by vLLM after every step ----------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **kwargs):
        self.pacer.propose_started()
        self._find_handoff()
        out: list[list[int]] = [[] for _ in sampled_token_ids]
        claimed, to_draft = set(), []
        for i, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[i])
            room = min(self.k, self.max_len - n - 1)
            if not len(sampled) or room < 1:
                continue
            row = np.asarray(token_ids_cpu[i, :n])
            tokens = row.tolist()
            seq = self._match(tokens, claimed)
            gram = self._ngram(row, room)
            if seq is not None:
                claimed.add(id(seq))
                seq.claimed = True
                self._account(seq, tokens)
                ahead = self._ahead(seq, tokens, room)
                if ahead:
                    out[i] = gram if len(gram) > len(ahead) and gram[: len(ahead)] == ahead else ahead
                    seq.proposed = (len(tokens), list(out[i]))
                    self.stats["predrafts_used"] += 1
                    continue
            if gram:
                out[i] = gram
                self.stats["ngram"] += 1
                continue
            if seq is not None and self.draft is not None:
                x = min(self.pacer.horizon(seq.estimate, room), seq.capacity - (len(tokens) - seq.prefix_len))
                if x > 0:
                    to_draft.append((i, seq, tokens, x))
                else:
                    self.stats["paced_off"] += 1
        if to_draft:
            self._draft_rows(to_draft, out)
        with self._lock:  # a claimed state missing from this step has finished (or was preempted)
            for key in [key for key, s in self.seqs.items() if s.claimed and id(s) not in claimed]:
                del self.seqs[key]
        self.stats["proposals"] += 1
        if self.stats["proposals"] % LOG_EVERY == 0:
            logger.info("VeriCache proposer: %s, %s", self.stats, self.pacer.describe())
        self.pacer.propose_ended(sum(len(o) for o in out))
        return out

    def _account(self, seq: _Seq, tokens: list[int]) -> None:
        """Acceptance of the compressed drafts proposed last step: how far the row followed them."""
        if seq.proposed is None:
            return
        at, drafts = seq.proposed
        seq.proposed = None
        n = 0
        while n < len(drafts) and at + n < len(tokens) and tokens[at + n] == drafts[n]:
            n += 1
        if len(tokens) > at:  # the step ran: n of the drafts accepted
            seq.estimate.update(n, len(drafts))

    def _ahead(self, seq: _Seq, tokens: list[int], room: int) -> list[int]:
        """Drafts already made past the row (a pre-draft, or earlier drafts still on the emitted path)."""
        with self._lock:
            seq.predrafting = False  # the request is running: its pre-draft stops where it is
            m = _common(seq.tokens, tokens, seq.prefix_len)
            if m == len(tokens) and len(seq.tokens) > m:
                return seq.tokens[m : m + room]
        return []

    def _draft_rows(self, rows: list[tuple[int, _Seq, list[int], int]], out: list[list[int]]) -> None:
        """x_r compressed-KV drafts for each row, all rows in one forward per draft step."""
        with self.gate.draft():
            with self._lock:
                for _, seq, tokens, _ in rows:  # roll the cache back to what the row still shares
                    keep = min(_common(seq.tokens, tokens, seq.prefix_len), seq.in_cache, len(tokens) - 1)
                    seq.cache.lengths[0] = seq.kept + keep - seq.prefix_len
                    seq.tokens, seq.in_cache = list(tokens), keep
            for step in range(max(x for *_, x in rows)):
                self._step([seq for _, seq, _, x in rows if step < x])
        for i, seq, tokens, x in rows:
            out[i] = seq.tokens[len(tokens) : len(tokens) + x]
            seq.proposed = (len(tokens), list(out[i]))

    def _ngram(self, row: np.ndarray, room: int) -> list[int]:
        if _ngram_match is None:
            return []
        got = _ngram_match(row.astype(np.int32), self.ngram[0], self.ngram[1], self.max_len, room)
        return [int(t) for t in got]

    # ---- draft states -----------------------------------------------------------------------------------
    def _match(self, row: list[int], claimed: set[int]) -> _Seq | None:
        best, best_m, hashes = None, -1, {}
        with self._lock:
            for seq in self.seqs.values():
                if id(seq) in claimed or seq.prefix_len >= len(row):
                    continue
                h = hashes.setdefault(seq.prefix_len, hash(tuple(row[: seq.prefix_len])))
                if h != seq.prefix_hash:
                    continue
                m = _common(seq.tokens, row, seq.prefix_len)
                if m > best_m:
                    best, best_m = seq, m
        if best is not None:
            return best
        handoff = self.handoff
        found = None if handoff is None or self.draft is None else handoff.find(row)
        return None if found is None else self._new_seq(row, found[0], found[1])

    def _new_seq(self, tokens: list[int], prefix_len: int, compressed: CompressedKV) -> _Seq | None:
        room = min(self.max_len - prefix_len, len(tokens) - prefix_len + CACHE_ROOM)
        try:
            cache = make_draft_cache(self.draft, [compressed], room, self.draft_cfg)
        except Exception as e:  # noqa: BLE001 - a copy that does not fit: no drafts for it
            logger.warning("VeriCache proposer: compressed copy unusable (%s: %s)", type(e).__name__, e)
            return None
        kept = int(cache.lengths[0])
        nbytes = (kept + room) * self.draft.cfg.kv_bytes_per_token(2)
        seq = _Seq(
            prefix_len, hash(tuple(tokens[:prefix_len])), kept, cache, room, nbytes, tokens[:prefix_len], prefix_len
        )
        with self._lock:
            self.seqs[self._next_id] = seq
            self._next_id += 1
            while len(self.seqs) > MAX_SEQS or sum(s.nbytes for s in self.seqs.values()) > MAX_DRAFT_BYTES:
                oldest = next(iter(self.seqs))
                if self.seqs[oldest] is seq:
                    break
                del self.seqs[oldest]
        return seq

    @staticmethod
    def _room(seq: _Seq) -> bool:
        return len(seq.tokens) - seq.prefix_len < seq.capacity


def _common(a: list[int], b: list[int], start: int) -> int:
    """Length of the common prefix of a and b, knowing the first `start` tokens agree."""
    n = min(len(a), len(b))
    i = start
    while i < n and a[i] == b[i]:
        i += 1
    return i


try:  # vLLM's own prompt-lookup matcher (the `ngram` method's), so our n-gram drafts are exactly its drafts
    from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as _ngram_match
except ImportError:  # pragma: no cover - another vLLM version: no n-gram drafts
    _ngram_match = None
