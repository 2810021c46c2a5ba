"""The verifier's core (no network): resident full KV per request under a memory budget, and verify calls
from many drafters batched into one forward.

Per request r the verifier keeps a Resident: a batch-1 KVCache holding the exact KV of `tokens` (the stored
prefix loaded from the store, then every token its verify forwards kept). A call for r carries the whole
sequence seq = prompt + emitted and the drafts d_1..d_x; with keep = the longest common prefix of tokens and
seq (at most len(seq) - 1, so at least one token is fed), one forward over feed = seq[keep:] + d gives the
full-KV logits at the last x + 1 positions: z_0 predicts d_1, ..., z_x predicts the token after d_x. Then
  greedy:   n = leading i with d_i == argmax z_{i-1}; token = argmax z_n (correction, or bonus if n == x)
  sampling: Leviathan et al.'s rule with the drafter's q and p = softmax(z / T) (model/sampling.verify)
and the resident keeps seq + d_1..d_n (lengths rolled back past them). Because a call names the whole
sequence, a retried call, a call after an eviction or after a verifier restart is answered the same way
(a lost resident is loaded again). Nothing the drafter sends is trusted beyond that: ids are range-checked,
the stored prefix must be whole chunks, the model must be ours.

Batching: calls of different requests whose feeds are short (steady state: pending + drafts) run as the
rows of one forward, each row attending over its own resident (GroupCache), feeds padded to the longest
(padded entries are written past the row's end and dropped by the rollback). Long feeds (a request's
first call, which also prefills the prompt's suffix) run alone. On the CPU the weights' pass dominates a
forward at these sizes, so B rows cost far less than B forwards.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..model.kv_cache import KVCache, RowCache
from ..model.sampling import verify
from . import rpc

Tensor = torch.Tensor


@dataclass
class VerifierConfig:
    memory_bytes: int = 4 << 30  # resident full KV of all requests together (LRU eviction beyond)
    ttl_s: float = 30.0  # a resident not used this long is freed (its drafter died or gave up)
    max_batch: int = 8  # rows per forward
    batch_max_feed: int = 64  # feeds longer than this run alone
    chunk_size: int = 256  # the store's chunk size: stored prefixes are whole chunks

    def __post_init__(self):
        for name in ("memory_bytes", "max_batch", "batch_max_feed", "chunk_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if not (isinstance(self.ttl_s, (int, float)) and math.isfinite(self.ttl_s) and self.ttl_s > 0):
            raise ValueError(f"ttl_s must be > 0, got {self.ttl_s!r}")


class CallError(ValueError):
    """A call the verifier refuses; `code` goes into the Failure."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class Resident:
    def __init__(self, cache: KVCache, prefix: list[int], nbytes: int):
        self.cache, self.prefix, self.nbytes = cache, prefix, nbytes
        self.tokens: list[int] = list(prefix)  # what the cache holds (valid once `ready`)
        self.ready = False  # the full copy is in
        self.last_used = time.monotonic()


class GroupCache(RowCache):
    """B batch-1 KVCaches as the rows of one forward: projections and MLPs run batched, each row's
    attention runs over its own cache."""

    def __init__(self, caches: list[KVCache]):
        self.caches = caches
        self.lengths = torch.cat([c.lengths for c in caches])

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return torch.cat([c.attend(layer, q[b : b + 1], k[b : b + 1], v[b : b + 1]) for b, c in enumerate(self.caches)])

    def advance(self, q: int) -> None:
        for c in self.caches:
            c.advance(q)
        self.lengths += q


class VerifierCore:
    def __init__(self, model, model_name: str, cfg: VerifierConfig | None = None):
        self.model, self.model_name, self.cfg = model, model_name, cfg or VerifierConfig()
        self.bytes_per_token = model.cfg.kv_bytes_per_token(model.dtype.itemsize)
        self.residents: OrderedDict[str, Resident] = OrderedDict()
        self.counts = dict(calls=0, forwards=0, batched_rows=0, max_batch=0, loads=0, evicted=0, expired=0, released=0)

    # ---- checks ------------------------------------------------------------------------------------
    def check(self, call: rpc.Verify) -> None:
        """CallError for a call this verifier cannot answer (before any work is done for it)."""
        c = self.model.cfg
        if call.model != self.model_name:
            raise CallError("model", f"this verifier serves {self.model_name!r}, the call is for {call.model!r}")
        if not 0 < len(call.request) <= 128:
            raise CallError("malformed", f"request id must be 1-128 characters, got {len(call.request)}")
        if len(call.drafts) > rpc.MAX_DRAFTS:
            raise CallError("too_large", f"{len(call.drafts)} drafts in one call, the limit is {rpc.MAX_DRAFTS}")
        n = len(call.prompt) + len(call.emitted) + len(call.drafts)
        if n + 1 > c.max_position:
            raise CallError("too_large", f"{n} tokens exceed the model's context of {c.max_position}")
        if not (0 < call.stored < len(call.prompt) and call.stored % self.cfg.chunk_size == 0):
            raise CallError(
                "malformed",
                f"stored={call.stored} must be whole chunks of {self.cfg.chunk_size} and shorter than the "
                f"{len(call.prompt)}-token prompt",
            )
        for name in ("prompt", "emitted", "drafts"):
            ids = getattr(call, name)
            if ids and not (0 <= min(ids) and max(ids) < c.vocab_size):
                raise CallError("malformed", f"{name} holds token ids outside [0, {c.vocab_size})")
        if not (0 < call.max_new <= c.max_position):
            raise CallError("malformed", f"max_new must be in [1, {c.max_position}], got {call.max_new}")
        if not (math.isfinite(call.temperature) and call.temperature >= 0):
            raise CallError("malformed", f"temperature must be a finite number >= 0, got {call.temperature}")
        want = 4 * len(call.drafts) * c.vocab_size if call.temperature > 0 else 0
        if len(call.q) != want:
            raise CallError("malformed", f"q has {len(call.q)} bytes, expected {want} (4 x drafts x vocab)")

    # ---- residents --------------------------------------------------------------------------------
    def resident(self, call: rpc.Verify) -> Resident | None:
        """The request's resident KV if it holds this call's stored prefix (used: moved to the LRU end)."""
        r = self.residents.get(call.request)
        if r is None or r.prefix != call.prompt[: call.stored]:
            return None
        self.residents.move_to_end(call.request)
        r.last_used = time.monotonic()
        return r

    def admit(self, call: rpc.Verify, pinned: set[str]) -> Resident:
        """A new resident for the call (its KV still to be loaded), evicting least recently used ones that
        are not `pinned` (in a forward or loading) to stay within the memory budget."""
        self.drop(call.request)
        room = len(call.prompt) + call.max_new + rpc.MAX_DRAFTS + 2
        capacity = min(room, self.model.cfg.max_position + rpc.MAX_DRAFTS)
        nbytes = capacity * self.bytes_per_token
        if nbytes > self.cfg.memory_bytes:
            raise CallError("busy", f"the request needs {nbytes} bytes of KV, the budget is {self.cfg.memory_bytes}")
        for name in [n for n in self.residents if n not in pinned]:
            if self.used_bytes() + nbytes <= self.cfg.memory_bytes:
                break
            self.drop(name)
            self.counts["evicted"] += 1
        if self.used_bytes() + nbytes > self.cfg.memory_bytes:
            raise CallError("busy", "the verifier's KV budget is taken by requests in flight; try later")
        r = Resident(self.model.new_cache(1, capacity), list(call.prompt[: call.stored]), nbytes)
        self.residents[call.request] = r
        self.counts["loads"] += 1
        return r

    def used_bytes(self) -> int:
        return sum(r.nbytes for r in self.residents.values())

    def drop(self, request: str) -> bool:
        return self.residents.pop(request, None) is not None

    def expire(self, now: float, pinned: set[str]) -> list[str]:
        gone = [n for n, r in self.residents.items() if n not in pinned and now - r.last_used > self.cfg.ttl_s]
        for n in gone:
            self.drop(n)
        self.counts["expired"] += len(gone)
        return gone

    # ---- verify -------------------------------------------------------------------------------------
    def plan(self, call: rpc.Verify, r: Resident) -> tuple[int, list[int]]:
        """(keep, feed): the resident's entries kept and the tokens this call feeds."""
        seq = call.prompt + call.emitted
        t = r.tokens
        keep = len(t) if len(t) <= len(seq) and seq[: len(t)] == t else _common(t, seq)
        keep = min(keep, len(seq) - 1)
        return keep, seq[keep:] + list(call.drafts)

    @torch.inference_mode()
    def verify(self, calls: list[tuple[rpc.Verify, Resident]]) -> list[rpc.Verdict]:
        """One forward over every call's feed (rows of one batch); each resident keeps what was accepted."""
        plans = [self.plan(call, r) for call, r in calls]
        width = max(len(feed) for _, feed in plans)
        dev = self.model.device
        ids, pos = [], []
        for (call, r), (keep, feed) in zip(calls, plans):
            if keep + width > r.cache.capacity:  # a request that ran past its max_new hint: grow
                self._grow(r, keep + width)
            r.cache.lengths[0] = keep
            ids.append(feed + [feed[-1]] * (width - len(feed)))
            pos.append(list(range(keep, keep + width)))
        caches = [r.cache for _, r in calls]
        cache = caches[0] if len(caches) == 1 else GroupCache(caches)
        h, _ = self.model.hidden_states(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), cache)
        # logits only where a verdict needs them: the last x + 1 positions of each row's real feed
        picks = [
            h[b, len(feed) - len(call.drafts) - 1 : len(feed)]
            for b, ((call, _), (_, feed)) in enumerate(zip(calls, plans))
        ]
        logits = self.model.logits(torch.cat(picks))
        out, at = [], 0
        for (call, r), (keep, feed) in zip(calls, plans):
            x = len(call.drafts)
            z = logits[at : at + x + 1][None]
            at += x + 1
            n, token = self._accept(call, z)
            r.tokens = call.prompt + call.emitted + list(call.drafts[:n])
            r.cache.lengths[0] = len(r.tokens)
            r.last_used = time.monotonic()
            out.append(rpc.Verdict(call.request, call.seq, n, token, batch=len(calls)))
        self.counts["calls"] += len(calls)
        self.counts["forwards"] += 1
        self.counts["max_batch"] = max(self.counts["max_batch"], len(calls))
        if len(calls) > 1:
            self.counts["batched_rows"] += len(calls)
        return out

    def _accept(self, call: rpc.Verify, z: Tensor) -> tuple[int, int]:
        """z [1, x + 1, V] -> (accepted, next token), by the one accept rule (model/sampling.verify)."""
        x, dev = len(call.drafts), z.device
        d = torch.tensor([list(call.drafts)], dtype=torch.long, device=dev)
        gen, q = None, None
        if call.temperature > 0:
            gen = torch.Generator().manual_seed((call.seed * 1_000_003 + len(call.emitted)) % (1 << 63))
            if x:
                q = torch.frombuffer(bytearray(call.q), dtype=torch.float32).view(1, x, -1).to(dev)
        n, token = verify(d, z, call.temperature, q, gen)
        return int(n[0]), int(token[0])

    def _grow(self, r: Resident, need: int) -> None:
        if need > self.model.cfg.max_position + rpc.MAX_DRAFTS:
            raise CallError("too_large", f"the request needs {need} positions, past the model's context")
        keep = int(r.cache.lengths[0])
        bigger = self.model.new_cache(1, need + rpc.MAX_DRAFTS)
        for layer in range(len(bigger.keys)):
            bigger.keys[layer][0, :, :keep] = r.cache.keys[layer][0, :, :keep]
            bigger.values[layer][0, :, :keep] = r.cache.values[layer][0, :, :keep]
        r.cache, r.nbytes = bigger, bigger.capacity * self.bytes_per_token

    def usage(self, failures: dict[str, int]) -> rpc.Usage:
        return rpc.Usage(
            residents=len(self.residents),
            resident_bytes=self.used_bytes(),
            budget_bytes=self.cfg.memory_bytes,
            failures=dict(failures),
            **self.counts,
        )


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
