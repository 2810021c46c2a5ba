"""The connector's scheduler side (vLLM's engine-core process): which prompts have stored prefixes to
load, and when a computed prompt's whole chunks are ready to save.

A prompt whose leading chunks are in the store is loaded asynchronously where loading pays (load_plan.py:
the link's and the prefill's measured rates and what is queued on each; "load_policy": "always" loads every
hit): get_num_new_matched_tokens answers (tokens, True), vLLM allocates blocks and keeps the request waiting
until the worker reports it finished; otherwise (0, False) and vLLM computes the prefix (with our proposer,
its compressed copy is still fetched to draft on). With vLLM's prefix cache on, a request whose stored
prefix another request is loading or computing right now waits for it (None: vLLM asks again next step)
and then finds it in vLLM's own cache: the link never carries the same prefix twice at once. When a load fails (the worker reports its blocks), vLLM's recompute policy either asks us
again (nothing valid was loaded) or schedules it with fewer computed tokens than we loaded (a local
prefix-cache hit before the loaded part stays valid): either way the prompt is computed here and its
stored copy rewritten (what the failed load found broken). A store that is down or slow is a miss, never a
failed request, and never stops vLLM's scheduler: lookups run on the store loop (breaker.py; a store that fails
one is marked down for a while: no lookups, no saves).
A request whose kv_transfer_params say {"vericache": "off"} neither loads nor saves: it recomputes its prompt
(benchmarks/disaggregated.py's recompute baseline, on the same server as its full-copy fetch).
A prefix saved or loaded lately is not saved again: with vLLM's prefix cache on, a repeated prompt (a
verifier's calls for one request, beside the store) would otherwise be copied out and compressed each time.
One that the store then no longer holds whole (a corrupt manifest or payload is a miss, or evicted) is
computed and rewritten (overwrite) by the next request that asks for it.
"""

from __future__ import annotations

import collections
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from vllm.logger import init_logger

from storage_backends import stored_prefix_len

from ....store.client import StoreClient
from ..handoff import row_key
from .breaker import LOOKUP_WAIT_S, Lookup, StoreBreaker
from .config import ConnectorSpec
from .load_plan import PROBE_WAIT_S, LoadPlanner
from .metadata import LoadSpec, SaveSpec, VeriCacheMetadata, VeriCacheWorkerMeta
from .stats import StatsRecorder

logger = init_logger("vllm.vericache")
RECENT_PREFIXES = 4096  # prefixes saved or loaded lately, not saved again (one the store no longer holds is
# rewritten by the next request that asks for it: _should_hold)
SAVE_SETTLE_S = 60.0  # a save this old has ended (worker.SAVE_TIMEOUT_S and then some)


def unkeyed_input(request) -> str | None:
    """What of the request the store's keys do not cover (they cover the prompt's token ids, the served model
    and the deployment's cache_salt), where vLLM's own block hashes do: a per-request cache_salt (tenants never
    share an entry), a LoRA adapter (its KV is not the base model's), multimodal input or prompt embeddings
    (the token ids do not say what was attended). Such a request is neither looked up nor saved."""
    if getattr(request, "cache_salt", None):
        return "a cache_salt"
    if getattr(request, "lora_request", None) is not None:
        return "a LoRA adapter"
    if getattr(request, "mm_features", None):
        return "multimodal input"
    if getattr(request, "prompt_embeds", None) is not None:
        return "prompt embeddings"
    return None


_TOLD: set[str] = set()  # the kinds of unkeyed request already logged (once per process each)


def connector_off(request) -> bool:
    """kv_transfer_params {"vericache": "off"}, or input the store's keys do not cover: the connector leaves
    this request alone."""
    params = getattr(request, "kv_transfer_params", None)
    if isinstance(params, dict) and params.get("vericache") == "off":
        return True
    why = unkeyed_input(request)
    if why is not None and why not in _TOLD:
        _TOLD.add(why)
        logger.warning(
            "VeriCache: requests with %s are neither looked up in nor saved to the store (its keys cover the "
            "prompt's tokens and the model; vLLM's own prefix cache still serves them)",
            why,
        )
    return why is not None


TWIN_WAIT_S = 60.0  # a request waits at most this long for another's load or prefill of its stored prefix


def prefix_key(prefix: list[int]) -> tuple[int, int]:
    return len(prefix), hash(tuple(prefix))


@dataclass
class _Owner:  # the request bringing a stored prefix into vLLM's blocks (loading or computing it)
    rid: str
    loading: bool
    since: float


@dataclass
class _Pending:  # a request whose prompt is not yet saved
    prompt: list[int]
    stored: int
    block_ids: list[int]
    overwrite: bool = False


@dataclass
class _Request:
    """What the scheduler side knows of one request: from vLLM's first question about it to request_finished."""

    prompt_len: int | None = None  # its stored prefix was decided on: its prefill left is tracked
    planned: bool = False  # its load-or-recompute decision was logged
    probing: float | None = None  # waiting for the link's first measure: since when
    lookup: int | None = None  # stored tokens to load (decided; blocks not yet allocated)
    pending: _Pending | None = None  # its prompt is not yet saved
    loaded: int | None = None  # tokens loaded (a loaded request is not saved)
    repair: bool = False  # its load failed, or its stored copy is broken: save (overwrite) after computing
    told: bool = False  # seeded sampled: named to the worker (the proposer offers it no drafts)
    asking: Lookup | None = None  # its lookup, in flight on the store loop (breaker.py)


class VeriCacheConnectorScheduler:
    def __init__(self, spec: ConnectorSpec, client: StoreClient):
        self.cfg, self.block_size, self.compressor, self.client = spec.cfg, spec.block_size, spec.compressor, client
        self.spec = spec
        self.planner = LoadPlanner(spec.cfg.chunk_size)
        self._owners: dict[tuple[int, int], _Owner] = {}  # stored prefix -> who brings it in now
        self._requests: dict[str, _Request] = {}  # req_id -> what is known of it, until request_finished
        self._steps: collections.deque[tuple[float, int]] = collections.deque()  # built, not yet answered
        self._drafts_only: list[LoadSpec] = []  # compressed copies to fetch for recomputed prefixes
        self._loads: dict[str, LoadSpec] = {}  # this step's loads (allocated), for the next metadata
        self._recent: OrderedDict[tuple[int, int], tuple[str, float]] = OrderedDict()  # (loaded | saved, when)
        self._seeded: list[tuple[int, int]] = []  # seeded sampled requests not told to the worker yet
        self.stats = StatsRecorder()  # get_kv_connector_stats (stats.py)
        self.breaker = StoreBreaker(spec.cfg.url)  # a store that failed a lookup is not asked for a while

    def _request(self, rid: str) -> _Request:
        """`rid`'s record, made when vLLM first asks about it (request_finished drops it)."""
        req = self._requests.get(rid)
        if req is None:
            req = self._requests[rid] = _Request()
        return req

    def _seen(self, prefix: list[int], remember: str | None = None) -> bool:
        """Whether `prefix` was saved or loaded lately (remember="saved" / "loaded": it is now)."""
        key = (len(prefix), hash(tuple(prefix)))
        seen = key in self._recent
        if seen or remember:
            self._recent[key] = (remember, time.monotonic()) if remember else self._recent[key]
            self._recent.move_to_end(key)
            while len(self._recent) > RECENT_PREFIXES:
                self._recent.popitem(last=False)
        return seen

    def _should_hold(self, prefix: list[int]) -> bool:
        """The store should hold `prefix` whole: loaded from it lately, or saved long enough ago that the
        save has ended (a save runs after its request's forward, so a repeat of the prompt can come first)."""
        got = self._recent.get((len(prefix), hash(tuple(prefix))))
        return got is not None and (got[0] == "loaded" or time.monotonic() - got[1] > SAVE_SETTLE_S)

    def _forget(self, prefix: list[int]) -> None:
        self._recent.pop((len(prefix), hash(tuple(prefix))), None)

    def stored_len(self, prompt: list[int]) -> int:
        return stored_prefix_len(len(prompt), self.cfg.chunk_size)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        prompt = list(request.prompt_token_ids or [])
        stored = self.stored_len(prompt)
        req = self._request(request.request_id)
        if stored <= num_computed_tokens or connector_off(request):
            return 0, False
        if req.loaded is not None:  # asked again: its load failed; compute, then rewrite
            req.loaded, req.repair = None, True
            return 0, False
        found = self._lookup(request.request_id, req, prompt[:stored])
        if found is None:
            return None, False  # the store has not answered yet: vLLM asks again next step
        if found < stored and self._should_hold(prompt[:stored]):  # loaded or saved here, now (partly) gone:
            logger.info(  # corrupt (a miss, logged by the store) or evicted: computed here, then rewritten
                "stored prefix of %s holds %d of %d tokens now: computing it and rewriting the copy",
                request.request_id,
                found,
                stored,
            )
            self._forget(prompt[:stored])
            req.repair = True
            return 0, False
        if found <= num_computed_tokens:
            return 0, False
        return self._decide(request, req, prompt, num_computed_tokens, found)

    def _lookup(self, rid: str, req: _Request, prefix: list[int]) -> int | None:
        """Tokens of `prefix` the store holds (whole chunks), 0 where it failed or is marked down, None while its
        lookup runs: vLLM's scheduler never waits on the store for more than LOOKUP_WAIT_S (breaker.py)."""
        if self.breaker.is_down():
            if req.asking is not None:
                req.asking.cancel()
                req.asking = None
            self.stats.count("lookups_skipped")
            return 0
        try:
            wait = 0.0  # asked again: the lookup has had its wait
            if req.asking is None:
                req.asking, wait = Lookup(self.client.submit(self.client.store.lookup(prefix))), LOOKUP_WAIT_S
            found = req.asking.result(wait, self.cfg.timeout_s)
        except Exception as e:  # noqa: BLE001 - the client is closed: the store is gone
            found = e
        if found is None:
            return None
        req.asking = None
        if isinstance(found, BaseException):  # down or slow: a miss (recompute), never a failed request
            self.stats.lookup(rid, found)
            if self.breaker.failed(found):
                self.stats.count("store_marked_down")
            logger.warning(
                "store lookup failed for %s (%s: %s): computing the prompt", rid, type(found).__name__, found
            )
            return 0
        self.breaker.answered()
        self.stats.lookup(rid, found, self.client, prefix, self.compressor.spec)
        return found

    def _decide(self, request, req: _Request, prompt: list[int], computed: int, found: int) -> tuple[int | None, bool]:
        rid = request.request_id
        key = prefix_key(prompt[:found])
        owner = self._owners.get(key)
        if owner is not None and owner.rid != rid and self.spec.prefix_caching:
            if time.monotonic() - owner.since < TWIN_WAIT_S:
                return None, False  # vLLM's cache gets it from the owner's load or prefill: ask again
        req.prompt_len = len(prompt)
        if self.spec.load_policy != "always" and self.planner.waits_for_probe(rid):
            now = time.monotonic()
            if req.probing is None:
                req.probing = now
            if now - req.probing < PROBE_WAIT_S:
                return None, False  # the first load measures the link within SPELL_S: decide then
        req.probing = None
        if self.spec.load_policy == "always":
            load = found - computed
        else:
            try:
                plan = self.planner.plan(rid, computed, found, len(prompt), getattr(request, "max_tokens", None))
            except Exception as e:  # noqa: BLE001 - a decision must never stop vLLM's scheduler: load it all
                logger.warning("VeriCache load-or-recompute failed (%s: %s): loading", type(e).__name__, e)
                plan = None
            load = found - computed if plan is None else plan.load
            if plan is not None and not req.planned:
                req.planned = True
                self.stats.count("load_decisions", plan.decision)
                logger.info("VeriCache load-or-recompute: %s: %s", rid, plan.describe())
        self._owners[key] = _Owner(rid, load > 0, time.monotonic())
        if found == self.stored_len(prompt):  # the store holds it whole: what is computed of it is not saved
            self._seen(prompt[:found], remember="loaded")  # again, here or by a twin served by vLLM's cache
        if load == 0:  # computed here: with our proposer, its compressed copy still comes to draft on
            self.planner.prefill_left(rid, len(prompt) - computed)
            self.planner.load_started(rid, 0)  # decided to load last time and not scheduled: not any more
            if self.spec.runs_proposer:
                self._drafts_only.append(
                    LoadSpec(rid, prompt[:found], [], computed, prompt, getattr(request, "max_tokens", None))
                )
            return 0, False
        self.planner.prefill_left(rid, len(prompt) - computed - load)
        self.planner.load_started(rid, load)
        req.lookup = computed + load
        return load, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        rid = request.request_id
        req = self._request(rid)
        prompt = list(request.prompt_token_ids or [])
        sp = getattr(request, "sampling_params", None)
        if sp is not None and sp.temperature > 0 and sp.seed is not None and not req.told:
            req.told = True  # the proposer offers it no drafts (handoff.py): the same output every time
            self._seeded.append(row_key(prompt))
        if connector_off(request):
            return
        if num_external_tokens > 0 and req.lookup is not None:
            found, req.lookup = req.lookup, None
            self._loads[rid] = LoadSpec(
                rid,
                prompt[:found],
                list(blocks.get_block_ids()[0]),
                found - num_external_tokens,
                prompt,
                getattr(request, "max_tokens", None),
            )
            req.loaded = found
            self._seen(prompt[:found], remember="loaded")
            return
        stored = self.stored_len(prompt)
        if (
            stored > 0
            and not self.breaker.is_down()  # a save would wait out the stalled store: the next request saves it
            and req.pending is None
            and req.loaded is None
            and (req.repair or not self._seen(prompt[:stored]))
        ):
            req.pending = _Pending(prompt, stored, [], overwrite=req.repair)
            req.repair = False

    def build_connector_meta(self, scheduler_output) -> VeriCacheMetadata:
        meta = VeriCacheMetadata(
            loads=list(self._loads.values()),
            idle=not scheduler_output.total_num_scheduled_tokens,
            seeded=self._seeded,
            drafts_only=self._drafts_only,
        )
        self._steps.append((time.monotonic(), scheduler_output.total_num_scheduled_tokens))
        self.planner.ran(len(scheduler_output.num_scheduled_tokens))  # a recompute delays each of them
        self._loads.clear()
        self._seeded, self._drafts_only = [], []
        progress: dict[str, tuple[int, list[int] | None]] = {}
        for r in scheduler_output.scheduled_new_reqs:
            progress[r.req_id] = (r.num_computed_tokens, list(r.block_ids[0]))
            req = self._requests.get(r.req_id)
            if req is not None and r.num_computed_tokens < (req.loaded or 0):  # its load failed past a valid part
                prompt = list(r.prompt_token_ids or [])
                req.loaded = None
                req.pending = _Pending(prompt, self.stored_len(prompt), [], overwrite=True)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            req = self._requests.get(rid)
            if rid in cached.resumed_req_ids and req is not None and req.pending is not None:  # preempted: all
                req.pending.block_ids = []  # blocks are new
            progress[rid] = (cached.num_computed_tokens[i], list(new[0]) if new else None)
        for rid, (computed, _) in progress.items():  # prefill still to compute, for the next decisions
            req = self._requests.get(rid)
            if req is not None and req.prompt_len is not None:
                done = computed + scheduler_output.num_scheduled_tokens.get(rid, 0)
                self.planner.prefill_left(rid, req.prompt_len - done)
                if done >= req.prompt_len - 1:
                    self._release(rid)
        for rid, (computed, new_blocks) in progress.items():
            req = self._requests.get(rid)
            p = None if req is None else req.pending
            if p is None:
                continue
            if new_blocks:
                p.block_ids.extend(new_blocks)
            if computed + scheduler_output.num_scheduled_tokens.get(rid, 0) >= p.stored:
                meta.saves.append(
                    SaveSpec(rid, p.prompt[: p.stored], p.block_ids[: p.stored // self.block_size], p.overwrite)
                )
                self._seen(p.prompt[: p.stored], remember="saved")
                req.pending = None
        return meta

    def update_connector_output(self, output) -> None:
        """A step's results: its time (the step-time fit), finished loads, the workers' link progress."""
        now = time.monotonic()
        meta = getattr(output, "kv_connector_worker_meta", None)
        if self._steps:  # the step's forward as the worker timed it (else: from build to output, propose included)
            built, tokens = self._steps.popleft()
            forward = getattr(meta, "forward_s", None)
            self.planner.steps.add(tokens, forward if forward is not None else now - built)
        for rid in output.finished_recving or ():
            self.planner.load_finished(rid)
            self._release(rid, loading_only=True)
        if isinstance(meta, VeriCacheWorkerMeta):
            self.planner.link_report(meta.link_tokens, meta.busy_s)
            if meta.predraft_value is not None:
                self.planner.predraft_value = meta.predraft_value

    def _release(self, rid: str, loading_only: bool = False) -> None:
        """`rid` has brought its stored prefix in (loaded, or computed past it): waiting twins go on."""
        for key in [k for k, o in self._owners.items() if o.rid == rid and (o.loading or not loading_only)]:
            del self._owners[key]

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        req = self._requests.pop(rid, None)
        if req is not None and req.asking is not None:
            req.asking.cancel()
        self._release(rid)
        self.planner.forget(rid)
        self.stats.forget(rid)
        return False, None
