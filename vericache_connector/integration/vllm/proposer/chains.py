"""The proposer's draft state per request: a Group of Chains.

A chain is one line of drafts: tokens = prompt + emitted + drafted, over its own draft cache (the compressed
prefix: `kept` entries standing for prefix_len tokens, then the KV of tokens[prefix_len:in_cache]). A request
starts with one chain; while its full copy loads, the pre-draft also grows BRANCHES, best first: every drafted
token leaves a candidate, the draft model's second choice there, whose path probability (the draft model's
probability of the chain's tokens up to there, times that of the second choice) is known; while the request
has fewer than MAX_BRANCHES chains, the likeliest candidate above BRANCH_P becomes one (a copy of its chain's
cache, rolled back to the branch point). When vLLM rejects a draft it emits the full model's own token,
which is the draft model's second choice more often than not: the branch that took it carries on with drafts
already made, instead of none. vLLM verifies one line per step; propose picks, each step, the chain that
extends what vLLM has emitted. (Extra chains cost little per step: a draft step reads the weights once for
all of them.)
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field

import torch

from ....engine.planner import AcceptanceEstimate
from ....model.kv_cache import RowCache

MAX_BRANCHES = 4  # chains per request (each holds a copy of the draft cache)
BRANCH_P = 0.15  # a branch's path probability (under the draft model) must be at least this
CANDIDATES = 16  # branch points remembered per request


@dataclass
class Group:
    prefix_len: int
    prefix_hash: int
    kept: int  # draft-cache entries of the compressed prefix
    capacity: int  # tokens a cache holds past the prefix
    chain_bytes: int  # one chain's draft cache
    estimate: AcceptanceEstimate  # per-draft acceptance of this request's compressed-KV drafts
    prompt_len: int = 0
    loaded: threading.Event | None = None  # the full copy is in (pre-drafts stop)
    chains: list["Chain"] = field(default_factory=list)
    claimed: bool = False  # by a row of vLLM's batch; a claimed group missing from a step has finished
    proposed: tuple[int, list[int], str] | None = None  # (row length, drafts, source) of the last proposal
    predraft_accepted: int = 0  # pre-drafted tokens vLLM accepted (the fetch decision learns from it)
    predraft_s: float | None = None  # how long it pre-drafted (from the copy's arrival to the full copy's)
    predraft_t0: float = 0.0
    candidates: list[tuple[float, "Chain", int, int]] = field(default_factory=list)  # (logp, chain, at, token)

    def add_candidate(self, logp: float, chain: "Chain", at: int, token: int) -> None:
        self.candidates.append((logp, chain, at, token))
        self.candidates.sort(key=lambda c: -c[0])
        del self.candidates[CANDIDATES:]

    def next_branch(self, min_logp: float) -> tuple[float, "Chain", int, int] | None:
        """The likeliest remembered branch point, if a chain may still be added and it is likely enough."""
        if len(self.chains) >= MAX_BRANCHES or not self.candidates or self.candidates[0][0] < min_logp:
            return None
        return self.candidates.pop(0)

    @property
    def nbytes(self) -> int:
        return self.chain_bytes * len(self.chains)

    def best(self, row: list[int]) -> tuple["Chain", int]:
        """The chain sharing the longest prefix with row (the first made, of equals: the likeliest line)."""
        scored = [(common(c.tokens, row, self.prefix_len), c) for c in self.chains]
        m = max(s for s, _ in scored)
        return next(c for s, c in scored if s == m), m

    def prune(self, row: list[int], keep: "Chain") -> None:
        """Drop the chains that left the emitted path (they cannot help any more); `keep` stays."""
        self.chains = [c for c in self.chains if c is keep or common(c.tokens, row, self.prefix_len) == len(row)]


@dataclass
class Chain:
    group: Group
    cache: RowCache
    tokens: list[int]
    in_cache: int
    predrafting: bool = False
    logp: float = 0.0  # log-probability under the draft model of the tokens it drafted

    @property
    def room(self) -> bool:
        return len(self.tokens) - self.group.prefix_len < self.group.capacity

    def rollback(self, row: list[int]) -> None:
        """Make the chain's tokens `row`, keeping the cache entries it still shares with it."""
        g = self.group
        keep = min(common(self.tokens, row, g.prefix_len), self.in_cache, len(row) - 1)
        self.cache.lengths[0] = g.kept + keep - g.prefix_len
        self.tokens, self.in_cache = list(row), keep

    def branch(self, at: int, token: int, logp: float) -> "Chain":
        """A new chain: this one's tokens up to `at`, then `token` (the caller adds it to the group). The
        cache is copied and rolled back to `at` (the entries before it are the same in both)."""
        g, cache = self.group, fork_cache(self.cache)
        cache.lengths[0] = g.kept + at - g.prefix_len
        return Chain(g, cache, self.tokens[:at] + [token], at, self.predrafting, logp)


def fork_cache(cache: RowCache) -> RowCache:
    """An independent copy of a draft cache (its tensors cloned; any kernel plan rebuilt on first use)."""
    out = copy.copy(cache)
    for name, value in vars(cache).items():
        if isinstance(value, torch.Tensor):
            setattr(out, name, value.clone())
        elif isinstance(value, list) and value and isinstance(value[0], (torch.Tensor, tuple, list)):
            setattr(out, name, [_clone(v) for v in value])
    for name in ("_plan_key", "_plan"):
        if hasattr(out, name):
            setattr(out, name, None)
    return out


def _clone(v):
    if isinstance(v, torch.Tensor):
        return v.clone()
    return type(v)(_clone(x) for x in v) if isinstance(v, (tuple, list)) else v


def common(a: list[int], b: list[int], start: int) -> int:
    """Length of the common prefix of a and b, knowing the first `start` tokens agree."""
    n = min(len(a), len(b))
    i = start
    while i < n and a[i] == b[i]:
        i += 1
    return i
