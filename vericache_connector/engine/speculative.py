"""The VeriCache loop: draft on the compressed KV, verify on the full KV, in one readable function.

Per row b the state between rounds is: `pending[b]`, the newest emitted token, whose KV is in neither
cache yet; the full cache holds the prompt plus every emitted token but `pending` (so its length is
also the true position of `pending`); the draft cache holds the compressed prompt plus the same
emitted tokens, with their EXACT (full-KV) keys and values.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..model.causal_lm import CausalLM
from ..model.kv_cache import KVCache, RowCache
from ..model.sampling import DecodeSettings, emit, sample, verify

Tensor = torch.Tensor


@dataclass
class DecodeConfig(DecodeSettings):
    """One request or a static batch (VeriCacheEngine). k_min, k_max, temperature, stop_at_eos: DecodeSettings."""

    max_new_tokens: int = 64
    draft_k: int = 8  # draft horizon (the start value when adaptive)
    adaptive: bool = False  # grow k on full acceptance, shrink it on early rejection
    seed: int | None = None

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 1 <= self.k_min <= self.draft_k <= self.k_max:
            raise ValueError(
                f"need 1 <= k_min <= draft_k <= k_max, got k_min={self.k_min}, "
                f"draft_k={self.draft_k}, k_max={self.k_max}"
            )
        super().__post_init__()

    @property
    def cache_headroom(self) -> int:
        """Entries a row may add past what its caches hold at the start: every emitted token, plus one
        round's drafts, plus the pending token and the bonus. A round drafts at most min(k_max, tokens
        still wanted) (draft_horizon), so this does not grow with k_max past max_new_tokens. (The round's
        drafts are also written into rows that have already finished, so they need the room too.)"""
        return self.max_new_tokens + min(self.k_max, self.max_new_tokens) + 2

    def generator(self) -> torch.Generator | None:
        return None if self.seed is None else torch.Generator().manual_seed(self.seed)


@dataclass
class SpecStats:
    accepted: list[list[int]] = field(default_factory=list)  # per row: drafts accepted per verification
    draft_lengths: list[int] = field(default_factory=list)  # k used in each round
    draft_s: float = 0.0
    verify_s: float = 0.0

    def mean_accepted(self) -> float:
        flat = [n for row in self.accepted for n in row]
        return sum(flat) / max(1, len(flat))


def draft_horizon(k: int, wanted: int, room: int) -> int:
    """Drafts of one round: k, but no more than are useful and no more than fit.

    wanted: the most tokens a live row still needs; a round emits its n <= k accepted drafts plus one
    bonus token, so wanted - 1 drafts are the most that can be used. room: free positions after the
    pending tokens in the tightest row (cache capacity, the model's context). At least 1."""
    return max(1, min(k, wanted - 1, room))


def _room(model, full: KVCache, p_len: int) -> int:
    """Positions a round can still write after the pending tokens: the full cache's free entries in its
    fullest row, and the model's context. (Draft caches get the same room past each row's prefix;
    cache_headroom covers the drafts that rows which have already finished still receive.)"""
    end = int(full.lengths.max()) + p_len
    room = model.cfg.max_position - end
    capacity = getattr(full, "capacity", None)
    return room if capacity is None else min(room, capacity - end)


def _emit(out: list[int], new: list[int], cfg: DecodeConfig, eos: tuple[int, ...]) -> bool:
    return emit(out, new, cfg.max_new_tokens, eos, cfg.stop_at_eos)


@torch.inference_mode()
def speculative_decode(
    model: CausalLM,
    full: KVCache,
    draft: RowCache,
    first: Tensor,
    cfg: DecodeConfig,
    on_tokens=None,
    arrival=None,
    draft_model: CausalLM | None = None,
) -> tuple[list[list[int]], SpecStats]:
    """Generate from B rows whose prompts are already in `full` (exact) and `draft` (compressed).

    first [B]: the first generated token (sampled from the full-KV prefill logits), or first [B, P]:
    the last P PROMPT tokens, in neither cache yet (a prefix-cache hit whose suffix still needs a
    forward). Then round 1 drafts from the compressed KV at once and the verify pass doubles as the
    suffix's prefill on the full KV.
    arrival: optional object with ready() -> bool and wait(); the full KV is still streaming in, so
    round 1 keeps drafting (up to k_max) until ready(), then wait()s before its verify pass.
    draft_model: what the draft steps run (default `model`; e.g. int8 weights, draft/weights.py).
    Returns the generated tokens per row (starting with the first one) and acceptance statistics.
    """
    drafter = draft_model or model
    b, dev, eos = full.batch, full.lengths.device, model.cfg.eos_token_ids
    gen = cfg.generator()
    outs = [[] for _ in range(b)]
    if first.dim() == 1:
        done = [_emit(outs[i], [int(first[i])], cfg, eos) for i in range(b)]
        pending = first[:, None].clone()
    else:
        done, pending = [False] * b, first.clone()
    stats = SpecStats(accepted=[[] for _ in range(b)])
    k = cfg.draft_k
    while not all(done):
        base_full, base_draft = full.lengths.clone(), draft.lengths.clone()
        p_len = pending.shape[1]
        # 1) DRAFT k tokens on the compressed KV: d_i ~ q_i = model(. | compressed prefix, emitted, d_<i).
        #    RoPE positions are the true ones (base_full + i), not the draft cache's own length.
        #    At most draft_horizon(...) of them: no more than the live rows still want, nor past the context.
        t0 = time.perf_counter()
        wanted = max(cfg.max_new_tokens - len(outs[i]) for i in range(b) if not done[i])
        room = _room(model, full, p_len)
        k_now = draft_horizon(k, wanted, room)
        k_wait = draft_horizon(cfg.k_max, wanted, room)  # while the full KV streams in
        x, drafts, q_probs = pending, [], []
        pos = base_full[:, None] + torch.arange(p_len, device=dev)[None]
        while len(drafts) < k_now or (arrival is not None and not arrival.ready() and len(drafts) < k_wait):
            logits, _ = drafter(x, pos, draft)
            tok, q_i = sample(logits[:, -1], cfg.temperature, gen)
            drafts.append(tok)
            q_probs.append(q_i)
            x, pos = tok[:, None], pos[:, -1:] + 1
        if arrival is not None:
            arrival.wait()  # the full KV is in the full cache from here on
            arrival = None
        d = torch.stack(drafts, 1)  # [B, k]
        k_round = d.shape[1]
        # 2) VERIFY all k in ONE forward over the full KV: inputs [pending, d_1..d_k] give the
        #    full-KV distributions p_1..p_{k+1} for positions base_full+P .. base_full+P+k.
        t1 = time.perf_counter()
        verify_in = torch.cat([pending, d], 1)
        positions = base_full[:, None] + torch.arange(p_len + k_round, device=dev)[None]
        target_logits, _ = model(verify_in, positions, full)
        target_logits = target_logits[:, p_len - 1 :]
        # 3) ACCEPT the longest prefix that the full model agrees with, plus one bonus token.
        q = torch.stack(q_probs, 1) if cfg.temperature > 0 else None
        n, bonus = verify(d, target_logits, cfg.temperature, q, gen)
        t2 = time.perf_counter()
        stats.draft_s += t1 - t0
        stats.verify_s += t2 - t1
        stats.draft_lengths.append(k_round)
        # 3b) EMIT the accepted drafts and the bonus token (up to the budget / EOS).
        active = [not x for x in done]
        for i in range(b):
            if not active[i]:
                continue
            ni = int(n[i])
            stats.accepted[i].append(ni)
            new = d[i, :ni].tolist() + [int(bonus[i])]
            done[i] = _emit(outs[i], new, cfg, eos)
            if on_tokens is not None:
                on_tokens(len(new))
        # 4) ROLL BACK both caches past the first rejection. The full cache keeps pending + n accepted
        #    (their KV from the verify pass is exact); the draft cache gets those same exact entries.
        #    Finished rows keep nothing more, so their later (ignored) writes stay within capacity.
        going = torch.tensor([a and not x for a, x in zip(active, done)], device=dev)
        keep = torch.where(going, n + p_len, torch.zeros_like(n))
        full.lengths = base_full + keep
        draft.copy_from(full, base_full, base_draft, keep)
        draft.lengths = base_draft + keep
        pending = bonus[:, None]
        if cfg.adaptive:
            act_n = [int(n[i]) for i in range(b) if active[i]]
            if act_n and min(act_n) == k_round:
                k = min(cfg.k_max, 2 * k)
            elif act_n and sum(act_n) / len(act_n) < k / 4:
                k = max(cfg.k_min, k // 2)
    return outs, stats


@torch.inference_mode()
def autoregressive_decode(
    model: CausalLM, cache: RowCache, first: Tensor, start_positions: Tensor, cfg: DecodeConfig, on_tokens=None
) -> list[list[int]]:
    """Plain one-token-at-a-time decoding on `cache` (full KV: the reference; compressed: lossy)."""
    b, eos = cache.batch, model.cfg.eos_token_ids
    gen = cfg.generator()
    outs = [[] for _ in range(b)]
    done = [_emit(outs[i], [int(first[i])], cfg, eos) for i in range(b)]
    x, pos = first.clone(), start_positions.clone()
    while not all(done):
        logits, _ = model(x[:, None], pos[:, None], cache)
        x, _ = sample(logits[:, -1], cfg.temperature, gen)
        pos += 1
        for i in range(b):
            if not done[i]:
                done[i] = _emit(outs[i], [int(x[i])], cfg, eos)
        if on_tokens is not None:
            on_tokens(1)
    return outs
