"""The proposer's draft state, per request: the draft model and the draft caches it drafts on.

A request the proposer can draft for has a Group (chains.py): its compressed prefix decoded into a draft cache
(the draft/ package's layout: paged float16 on the CPU) and the chains of drafts grown on copies of it. The
groups are an LRU of at most MAX_GROUPS requests and MAX_DRAFT_BYTES of caches in all (the least recently
matched dropped); a group a row of vLLM's batch claimed is dropped at the first step without that row (the
request finished, or was preempted), and what its pre-drafts earned is then handed to the pacer.

A group is built from a compressed copy the connector posted on the DraftHandoff: by the pre-draft (predraft.py)
as soon as the copy arrives, or, for a copy posted without one (a fast load), on a thread of its own from the
request's second step on, and only at a step where compressed drafts could pay (match). Both register the
copy's draft_key in `building` while they build, so that one prefix is never built twice at once.

`step` is one batched draft step over chains of any groups (the pre-draft's, or propose's); everything here
that touches groups and chains holds `lock`, shared with the pre-draft thread.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from typing import Callable

import torch
from vllm.logger import init_logger

from ....compressors import CompressedKV
from ....draft import DraftConfig, make_draft_cache
from ..handoff import Deferred, DraftHandoff, materialize
from .chains import BRANCH_P, Chain, Group
from .draft_model import DraftModel
from .pacing import DraftPacer, new_estimate

logger = init_logger("vllm.vericache")

MAX_GROUPS = 64  # requests with draft state (least recently used dropped)
MAX_DRAFT_BYTES = 1 << 30  # draft caches of all requests together
CACHE_ROOM = 512  # draft-cache entries past the prompt (pre-drafts and later drafts); then drafting stops


class DraftCaches:
    def __init__(self, max_len: int, cfg: DraftConfig, pacer: DraftPacer, stats: dict[str, int]):
        self.max_len, self.cfg, self.pacer, self.stats = max_len, cfg, pacer, stats
        self.draft: DraftModel | None = None  # the draft forward (load_model); None: no compressed-KV drafts
        self.view_drafting = False  # the proposer self-drafts on views of vLLM's KV: no cache built after a load
        self.groups: OrderedDict[int, Group] = OrderedDict()
        self.lock = threading.Lock()  # groups and their chains, shared with the pre-draft thread
        self.building: set[tuple[int, int]] = set()  # (prefix length, hash) of draft caches being built
        self._sighted: OrderedDict[tuple[int, int], bool] = OrderedDict()  # matched once: built at the next step
        self._next_id = 0

    def match(
        self,
        row: list[int],
        present: set[int],
        handoff: DraftHandoff | None,
        build: bool,
        could_pay: Callable[[], bool],
    ) -> Group | None:
        """The group of the request this row is (its stored prefix and chains), or (build, could_pay()) a new
        one from a compressed copy the connector posted on the handoff."""
        with self.lock:
            for g in self.groups.values():
                if id(g) not in present and g.prefix_len < len(row):
                    if hash(tuple(row[: g.prefix_len])) == g.prefix_hash:
                        self.groups.move_to_end(next(k for k, v in self.groups.items() if v is g))
                        return g
        found = None if handoff is None or self.draft is None else handoff.find(row)
        if found is None:
            return None
        # A copy posted without a pre-draft (a fast load): its draft cache is built on a thread of its own,
        # not in this call, which vLLM's step waits for; and from the request's second step on, so that the
        # build (and the cut of a Deferred copy) does not take the cores while its first token goes out; and
        # only at a step that may draft (build) at a batch size where its compressed drafts could pay.
        key = draft_key(row, found[0])
        with self.lock:
            if key in self.building:
                return None
            if key not in self._sighted:
                self._sighted[key] = True
                while len(self._sighted) > MAX_GROUPS:
                    self._sighted.popitem(last=False)
                return None
            if not (build and could_pay()):
                return None
            del self._sighted[key]
            self.building.add(key)

        threading.Thread(target=self.build, args=(key, row, *found), name="vericache-draft-cache", daemon=True).start()
        return None

    def build(self, key, tokens: list[int], prefix_len: int, compressed: CompressedKV | Deferred) -> Chain | None:
        """new_group for a draft cache its caller registered in `building` (key), released however it ends."""
        try:
            return self.new_group(tokens, prefix_len, compressed)
        finally:
            with self.lock:
                self.building.discard(key)

    def new_group(self, tokens: list[int], prefix_len: int, compressed: CompressedKV | Deferred) -> Chain | None:
        room = min(self.max_len - prefix_len, len(tokens) - prefix_len + CACHE_ROOM)
        try:
            cache = make_draft_cache(self.draft, [materialize(compressed)], room, self.cfg)
        except Exception as e:  # noqa: BLE001 - a copy that does not fit: no drafts for it
            logger.warning("VeriCache proposer: compressed copy unusable (%s: %s)", type(e).__name__, e)
            return None
        kept = int(cache.lengths[0])
        nbytes = (kept + room) * self.draft.cfg.kv_bytes_per_token(2)
        g = Group(prefix_len, hash(tuple(tokens[:prefix_len])), kept, room, nbytes, new_estimate())
        chain = Chain(g, cache, list(tokens[:prefix_len]), prefix_len)
        g.chains.append(chain)
        with self.lock:
            self.groups[self._next_id] = g
            self._next_id += 1
            while len(self.groups) > MAX_GROUPS or sum(x.nbytes for x in self.groups.values()) > MAX_DRAFT_BYTES:
                oldest = next(iter(self.groups))
                if self.groups[oldest] is g:
                    break
                self._drop(oldest)
        return chain

    def made(self, group: Group, row: list[int], room: int) -> list[int]:
        """Up to `room` drafts already made past `row` on the chain that follows it (none where no chain does);
        the request is running, so its pre-drafts stop where they are and chains off its path are dropped."""
        chain, m = group.best(row)
        with self.lock:
            chain.predrafting = False
            ahead = chain.tokens[m : m + room] if m == len(row) else []
            group.prune(row, chain)
        return ahead

    def finish_absent(self, present: set[int]) -> None:
        """A claimed group missing from this step has finished (or was preempted): drop it."""
        with self.lock:
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

    def step(self, chains: list[Chain], branch: bool = False) -> None:
        """One batched draft step: each chain feeds what its cache lacks and gets one greedy draft token; a
        pre-draft (branch=True) remembers the second choice as a branch point and grows the likeliest one."""
        feeds = [c.tokens[c.in_cache :] for c in chains]
        t0 = time.perf_counter()
        logits = self.draft.forward(feeds, [c.in_cache for c in chains], [c.cache for c in chains])
        top_p, top = torch.log_softmax(logits, -1).topk(2, dim=-1)
        if max(len(f) for f in feeds) == 1:  # a plain draft step (not a suffix or catch-up feed)
            self.pacer.drafted(time.perf_counter() - t0)
        groups = []
        with self.lock:
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
                with self.lock:
                    g.chains.append(other)
                    self.stats["branches"] += 1


def draft_key(tokens: list[int], n: int) -> tuple[int, int]:
    """(n, hash of the first n tokens): a draft cache's prefix, as `building` and `_sighted` know it."""
    return n, hash(tuple(tokens[:n]))
