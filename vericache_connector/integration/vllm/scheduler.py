"""The connector's scheduler side (vLLM's engine-core process): which prompts have stored prefixes to
load, and when a computed prompt's whole chunks are ready to save.

A prompt whose leading chunks are in the store is loaded asynchronously: get_num_new_matched_tokens
answers (tokens, True), vLLM allocates blocks and keeps the request waiting until the worker reports
it finished. When a load fails (the worker reports its blocks), vLLM's recompute policy either asks us
again (nothing valid was loaded) or schedules it with fewer computed tokens than we loaded (a local
prefix-cache hit before the loaded part stays valid): either way the prompt is computed here and its
stored copy rewritten (overwrite). A store that is down or slow is a miss, never a failed request.
A request whose kv_transfer_params say {"vericache": "off"} neither loads nor saves: it recomputes its prompt
(benchmarks/disaggregated.py's recompute baseline, on the same server as its full-copy fetch).
A prefix saved or loaded lately is not saved again: with vLLM's prefix cache on, a repeated prompt (a
verifier's calls for one request, beside the store) would otherwise be copied out and compressed each time.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from vllm.logger import init_logger

from storage_backends import stored_prefix_len

from ...store.client import StoreClient
from .config import ConnectorSpec
from .metadata import LoadSpec, SaveSpec, VeriCacheMetadata

logger = init_logger("vllm.vericache")
RECENT_PREFIXES = 4096  # prefixes saved or loaded lately, not saved again (a store that evicted one gets it
# back once it falls out of this window or the server restarts)


def connector_off(request) -> bool:
    """kv_transfer_params {"vericache": "off"}: the connector leaves this request alone."""
    params = getattr(request, "kv_transfer_params", None)
    return isinstance(params, dict) and params.get("vericache") == "off"


@dataclass
class _Pending:  # a request whose prompt is not yet saved
    prompt: list[int]
    stored: int
    block_ids: list[int]
    overwrite: bool = False


class VeriCacheConnectorScheduler:
    def __init__(self, spec: ConnectorSpec, client: StoreClient):
        self.cfg, self.block_size, self.compressor, self.client = spec.cfg, spec.block_size, spec.compressor, client
        self._lookups: dict[str, int] = {}  # req_id -> stored tokens to load
        self._loads: dict[str, LoadSpec] = {}
        self._pending: dict[str, _Pending] = {}
        self._loaded: dict[str, int] = {}  # req_id -> tokens loaded (loaded requests are not saved)
        self._repair: set[str] = set()  # their load failed: save (overwrite) after computing
        self._recent: OrderedDict[tuple[int, int], None] = OrderedDict()

    def _seen(self, prefix: list[int], remember: bool = False) -> bool:
        """Whether `prefix` was saved or loaded lately (remember=True: it is now)."""
        key = (len(prefix), hash(tuple(prefix)))
        seen = key in self._recent
        if seen or remember:
            self._recent[key] = None
            self._recent.move_to_end(key)
            while len(self._recent) > RECENT_PREFIXES:
                self._recent.popitem(last=False)
        return seen

    def stored_len(self, prompt: list[int]) -> int:
        return stored_prefix_len(len(prompt), self.cfg.chunk_size)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        prompt = list(request.prompt_token_ids or [])
        stored = self.stored_len(prompt)
        if stored <= num_computed_tokens or connector_off(request):
            return 0, False
        if request.request_id in self._loaded:  # asked again: its load failed; compute, then rewrite
            del self._loaded[request.request_id]
            self._repair.add(request.request_id)
            return 0, False
        try:
            found = self.client.call(self.client.store.lookup(prompt[:stored]))
        except Exception as e:  # down or slow: a miss (recompute), never a failed request
            logger.warning(
                "store lookup failed for %s (%s: %s): computing the prompt", request.request_id, type(e).__name__, e
            )
            return 0, False
        if found <= num_computed_tokens:
            return 0, False
        self._lookups[request.request_id] = found
        return found - num_computed_tokens, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        rid = request.request_id
        prompt = list(request.prompt_token_ids or [])
        if connector_off(request):
            return
        if num_external_tokens > 0 and rid in self._lookups:
            found = self._lookups.pop(rid)
            self._loads[rid] = LoadSpec(
                rid,
                prompt[:found],
                list(blocks.get_block_ids()[0]),
                found - num_external_tokens,
                prompt,
                getattr(request, "max_tokens", None),
            )
            self._loaded[rid] = found
            self._seen(prompt[:found], remember=True)
            return
        stored = self.stored_len(prompt)
        if (
            stored > 0
            and rid not in self._pending
            and rid not in self._loaded
            and (rid in self._repair or not self._seen(prompt[:stored]))
        ):
            self._pending[rid] = _Pending(prompt, stored, [], overwrite=rid in self._repair)
            self._repair.discard(rid)

    def build_connector_meta(self, scheduler_output) -> VeriCacheMetadata:
        meta = VeriCacheMetadata(loads=list(self._loads.values()), idle=not scheduler_output.total_num_scheduled_tokens)
        self._loads.clear()
        progress: dict[str, tuple[int, list[int] | None]] = {}
        for r in scheduler_output.scheduled_new_reqs:
            progress[r.req_id] = (r.num_computed_tokens, list(r.block_ids[0]))
            if r.num_computed_tokens < self._loaded.get(r.req_id, 0):  # its load failed past a valid part
                prompt = list(r.prompt_token_ids or [])
                del self._loaded[r.req_id]
                self._pending[r.req_id] = _Pending(prompt, self.stored_len(prompt), [], overwrite=True)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids and rid in self._pending:  # preempted: all blocks are new
                self._pending[rid].block_ids = []
            progress[rid] = (cached.num_computed_tokens[i], list(new[0]) if new else None)
        for rid, (computed, new_blocks) in progress.items():
            p = self._pending.get(rid)
            if p is None:
                continue
            if new_blocks:
                p.block_ids.extend(new_blocks)
            if computed + scheduler_output.num_scheduled_tokens.get(rid, 0) >= p.stored:
                meta.saves.append(
                    SaveSpec(rid, p.prompt[: p.stored], p.block_ids[: p.stored // self.block_size], p.overwrite)
                )
                self._seen(p.prompt[: p.stored], remember=True)
                del self._pending[rid]
        return meta

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        for d in (self._pending, self._lookups):
            d.pop(request.request_id, None)
        self._loaded.pop(request.request_id, None)
        self._repair.discard(request.request_id)
        return False, None
