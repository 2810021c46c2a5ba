"""Per-round accepted counts of greedy VeriCache at every draft horizon, from one set of draft rollouts.

Why one set suffices. In greedy VeriCache the emitted tokens are the full-KV greedy output r_0 r_1 ...
whatever the horizon, and a round starting after m emitted tokens sees the same draft cache every time:
the compressed prefix plus the EXACT (full-KV) keys and values of r_0 .. r_{m-2}, with r_{m-1} pending
(vericache_connector/engine/speculative.py copies the verified entries into the draft cache and rolls
the rest back). So the drafts of that round are the drafter's greedy continuation from state m, and a
round of horizon k accepts n = min(a(m), k_round) of them, where
    a(m) = how many leading tokens of the drafter's continuation from state m equal r_m, r_{m+1}, ...
    k_round = the drafts the round makes (k, or what engine.speculative.draft_horizon allows).
It emits n + 1 tokens (the accepted drafts and the verify pass's bonus token): the next state is
m + n + 1. A horizon's whole trace therefore follows from a() at the states it visits; the oracle
computes a(m) once per state (drafting until the first miss, at most k_max tokens) and every horizon
reuses it (rolling out only as far as the largest horizon that visits the state needs). Up to float rounding of the exact entries (one teacher-forced forward here, verify passes in a
real run), the traces are those of speculative_decode on one row; tests/unit/test_acceptance_oracle.py
and benchmarks/acceptance.py's real-run check compare them with engine.generate.
"""

from __future__ import annotations

import time

import torch

from vericache_connector.engine import speculative


def round_horizon(k: int, wanted: int) -> int:
    """Drafts a round makes on one row that still wants `wanted` tokens (as the engine decides)."""
    horizon = getattr(speculative, "draft_horizon", None)
    return k if horizon is None else horizon(k, wanted, 1 << 30)


def derive_trace(accepted_at, k: int, new_tokens: int) -> tuple[list[int], list[int]]:
    """(accepted per round, drafts per round) of horizon k; accepted_at(m, cap) = min(a(m), cap)."""
    emitted, accepted, drafted = 1, [], []  # the first token comes from the prefill logits
    while emitted < new_tokens:
        k_round = round_horizon(k, new_tokens - emitted)
        n = min(accepted_at(emitted, k_round), k_round)
        accepted.append(n)
        drafted.append(k_round)
        emitted += n + 1
    return accepted, drafted


class Oracle:
    """a(m) for one prompt and one compressed copy, drafting on a batch-1 draft cache.

    ref: the full-KV greedy tokens (at least new_tokens + k_max); exact: a full KV cache holding the
    prompt and every ref token (teacher-forced), whose entries are copied into the draft cache.
    (A plain class: benchmarks are loaded as scripts, which dataclasses cannot resolve.)"""

    def __init__(self, engine, prefill, compressed, ref: list[int], exact, k_max: int, draft_cfg=None):
        self.prefill, self.ref, self.exact, self.k_max = prefill, ref, exact, k_max
        self.memo: dict[int, int] = {}
        self.steps, self.draft_s = 0, 0.0
        self.model = engine.draft_model(draft_cfg)
        self.cache = engine.draft_cache([compressed], len(ref) + k_max + 2, draft_cfg)
        self.base = int(self.cache.lengths[0])  # compressed prefix entries
        self.t = prefill.num_tokens
        self.clean = 0  # entries after the prefix that hold exact KV of ref[0 .. clean-1]
        self.dev = self.model.device

    def __call__(self, m: int, cap: int | None = None) -> int:
        """min(a(m), cap): rolls out from state m at most once per needed cap (a run that stopped at a
        miss is exact for every cap; one that reached its cap is redone only for a larger one)."""
        cap = self.k_max if cap is None else min(cap, self.k_max)
        a, used = self.memo.get(m, (None, -1))
        if a is None or (a == used and cap > used):
            a, used = self._rollout(m, cap), cap
            self.memo[m] = (a, used)
        return min(a, cap)

    @torch.inference_mode()
    def _rollout(self, m: int, cap: int) -> int:
        """Drafts from state m (ref[0..m-1] emitted, ref[m-1] pending) until the first miss or cap."""
        if not 1 <= m < len(self.ref) - self.k_max + 1:
            raise ValueError(f"state {m} needs ref tokens up to {m + self.k_max}, have {len(self.ref)}")
        c, one = self.cache, torch.ones(1, dtype=torch.long, device=self.dev)
        if m - 1 > self.clean:  # copy the exact entries of ref[clean .. m-2]
            c.copy_from(
                self.exact, one * (self.t + self.clean), one * (self.base + self.clean), one * (m - 1 - self.clean)
            )
        c.lengths = torch.tensor([self.base + m - 1], device=self.dev)
        self.clean = m - 1  # the rollout overwrites entries from here on
        x = torch.tensor([[self.ref[m - 1]]], device=self.dev)
        pos = torch.tensor([[self.t + m - 1]], device=self.dev)
        a = 0
        t0 = time.perf_counter()
        while a < cap:
            logits, _ = self.model(x, pos, c)
            self.steps += 1
            d = int(logits[0, -1].argmax())
            if d != self.ref[m + a]:
                break
            a += 1
            x, pos = x.new_tensor([[d]]), pos + 1
        self.draft_s += time.perf_counter() - t0
        return a

    @property
    def draft_step_s(self) -> float:
        return self.draft_s / max(1, self.steps)


@torch.inference_mode()
def exact_cache(engine, prefill, ref: list[int]):
    """A batch-1 full KV cache with the prompt and the ref tokens' exact KV (one teacher-forced forward)."""
    cache = engine.full_cache([prefill], len(ref) + 2)
    t = prefill.num_tokens
    ids = torch.tensor([ref], device=engine.model.device)
    engine.model(ids, torch.arange(t, t + len(ref), device=ids.device)[None], cache)
    return cache


@torch.inference_mode()
def _forward_s(engine, prefill, width: int, draft=None) -> float:
    """Seconds of one forward of `width` new tokens at this prompt's context: on a fresh full KV cache,
    or (draft = a compressed copy, width 1) on a fresh batch-1 draft cache of it."""
    model, dev, t = engine.model, engine.model.device, prefill.num_tokens
    if draft is None:
        cache = engine.full_cache([prefill], width + 1)
    else:
        cache, model = engine.draft_cache([draft], width + 1), engine.draft_model()
    ids = torch.ones(1, width, dtype=torch.long, device=dev)
    pos = torch.arange(t, t + width, device=dev)[None]
    t0 = time.perf_counter()
    model(ids, pos, cache)
    return time.perf_counter() - t0


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def step_costs(engine, prefill, ks: list[int], repeats: int = 3) -> dict:
    """Batch 1 at this prompt's context: a one-token full-KV step (seconds) and a verify pass of k + 1
    tokens for every k, as a ratio to the full step measured right beside it (medians of `repeats`
    round-robin rounds after a warm-up round, so both sides see the same machine load)."""
    widths = [1] + [k + 1 for k in ks]
    times = {w: [] for w in widths}
    for r in range(repeats + 1):
        for w in widths:
            s = _forward_s(engine, prefill, w)
            if r:
                times[w].append(s)
    full = _median(times[1])
    return {"full_step_s": full, "verify_ratio": {k: _median(times[k + 1]) / full for k in ks}}


def draft_step_ratio(engine, prefill, compressed, repeats: int = 3) -> float:
    """A batch-1 draft step on this copy over a full-KV step, each measured right beside the other
    (median ratio of `repeats` pairs after a warm-up pair)."""
    ratios = []
    for r in range(repeats + 1):
        full = _forward_s(engine, prefill, 1)
        draft = _forward_s(engine, prefill, 1, compressed)
        if r:
            ratios.append(draft / full)
    return _median(ratios)


def trace_requests(k: int, new_tokens: int):
    """derive_trace as a generator: yields (m, cap) and is sent min(a(m), cap); returns the trace."""
    emitted, accepted, drafted = 1, [], []
    while emitted < new_tokens:
        k_round = round_horizon(k, new_tokens - emitted)
        n = min((yield emitted, k_round), k_round)
        accepted.append(n)
        drafted.append(k_round)
        emitted += n + 1
    return accepted, drafted


def derive_batched(accepted_at: list, k: int, new_tokens: int) -> tuple[list[list[int]], list[int]]:
    """Per-row accepted counts and per-round drafts of ONE batched run whose rows start together:
    every round drafts round_horizon(k, most tokens a live row still wants) for all live rows (as
    speculative_decode does). accepted_at[b](m, cap) = min(a_b(m), cap)."""
    rows = len(accepted_at)
    emitted, accepted, drafted = [1] * rows, [[] for _ in range(rows)], []
    while any(e < new_tokens for e in emitted):
        live = [b for b in range(rows) if emitted[b] < new_tokens]
        k_round = round_horizon(k, max(new_tokens - emitted[b] for b in live))
        drafted.append(k_round)
        for b in live:
            n = min(accepted_at[b](emitted[b], k_round), k_round)
            accepted[b].append(n)
            emitted[b] += n + 1
    return accepted, drafted


class BatchOracle:
    """Oracle for several compressed copies of ONE prompt at once: one draft cache with a row per copy,
    every draft step one batched forward over all rows that are rolling out (the others idle: they
    feed a dummy token whose entry is dropped again). Same a(m) as Oracle, row by row."""

    def __init__(self, engine, prefill, copies: list, ref: list[int], exact, k_max: int, draft_cfg=None):
        self.ref, self.exact, self.k_max, self.t = ref, exact, k_max, prefill.num_tokens
        self.model = engine.draft_model(draft_cfg)
        self.cache = engine.draft_cache(copies, len(ref) + k_max + 2, draft_cfg)
        self.rows = len(copies)
        self.base = self.cache.lengths.clone()
        self.clean = [0] * self.rows
        self.memo: list[dict[int, tuple[int, int]]] = [{} for _ in range(self.rows)]
        self.steps, self.step_s = 0, 0.0
        self.num_layers = len(exact.keys)

    def lookup(self, b: int, m: int, cap: int) -> int | None:
        a, used = self.memo[b].get(m, (None, -1))
        if a is None or (a == used and min(cap, self.k_max) > used):
            return None
        return min(a, cap)

    def _start(self, b: int, m: int, cap: int) -> dict:
        if not 1 <= m < len(self.ref) - self.k_max + 1:
            raise ValueError(f"state {m} needs ref tokens up to {m + self.k_max}, have {len(self.ref)}")
        if m - 1 > self.clean[b]:  # the exact entries of ref[clean .. m-2]
            s, n = self.clean[b], m - 1 - self.clean[b]
            for layer in range(self.num_layers):
                k = self.exact.keys[layer][0, :, self.t + s : self.t + s + n]
                v = self.exact.values[layer][0, :, self.t + s : self.t + s + n]
                self.cache.store_entries(layer, b, int(self.base[b]) + s, k, v)
        self.cache.lengths[b] = self.base[b] + m - 1
        self.clean[b] = m - 1
        return {"m": m, "cap": min(cap, self.k_max), "a": 0, "x": self.ref[m - 1], "pos": self.t + m - 1}

    @torch.inference_mode()
    def serve(self, next_request) -> None:
        """Roll out until no row has work: next_request(b) -> (m, cap) or None, asked whenever row b is
        free (it should first consume the answers now in the memo, see lookup)."""
        active: list[dict | None] = [None] * self.rows
        dev = self.model.device
        while True:
            for b in range(self.rows):
                if active[b] is None:
                    req = next_request(b)
                    if req is not None:
                        active[b] = self._start(b, *req)
            live = [b for b in range(self.rows) if active[b] is not None]
            if not live:
                return
            x = torch.zeros(self.rows, 1, dtype=torch.long, device=dev)
            pos = torch.full((self.rows, 1), self.t, dtype=torch.long, device=dev)
            for b in live:
                x[b, 0], pos[b, 0] = active[b]["x"], active[b]["pos"]
            t0 = time.perf_counter()
            logits, _ = self.model(x, pos, self.cache)
            self.step_s += time.perf_counter() - t0
            self.steps += 1
            drafts = logits[:, -1].argmax(-1).tolist()
            for b in range(self.rows):
                r = active[b]
                if r is None:
                    self.cache.lengths[b] -= 1  # an idle row's dummy entry is dropped again
                    continue
                if drafts[b] == self.ref[r["m"] + r["a"]]:
                    r["a"] += 1
                    r["x"], r["pos"] = drafts[b], r["pos"] + 1
                    if r["a"] < r["cap"]:
                        continue
                self.memo[b][r["m"]] = (r["a"], r["cap"])
                active[b] = None

    def traces(self, ks: list[int], new_tokens: int) -> list[dict[int, tuple[list[int], list[int]]]]:
        """Per row, per horizon k, (accepted per round, drafts per round) as derive_trace."""
        gens = [{k: trace_requests(k, new_tokens) for k in ks} for _ in range(self.rows)]
        waiting = [{k: next(g) for k, g in row.items()} for row in gens]  # k -> (m, cap)
        out: list[dict] = [{} for _ in range(self.rows)]

        def next_request(b):
            progressed = True
            while progressed:  # answer every horizon the memo can answer
                progressed = False
                for k, req in list(waiting[b].items()):
                    ans = self.lookup(b, *req)
                    if ans is None:
                        continue
                    progressed = True
                    try:
                        waiting[b][k] = gens[b][k].send(ans)
                    except StopIteration as stop:
                        out[b][k] = stop.value
                        del waiting[b][k]
            if not waiting[b]:
                return None
            m = min(m for m, _ in waiting[b].values())  # forward through the states
            return m, max(cap for mm, cap in waiting[b].values() if mm == m)

        self.serve(next_request)
        return out

    def accepted_at(self, b: int):
        """min(a_b(m), cap) for row b, rolling out (that row alone) when the memo cannot answer."""

        def at(m: int, cap: int) -> int:
            if self.lookup(b, m, cap) is None:
                todo = [(m, cap)]
                self.serve(lambda r: todo.pop() if r == b and todo else None)
            return self.lookup(b, m, cap)

        return at
