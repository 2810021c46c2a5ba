"""Prompt-lookup (n-gram) drafts: where the row's last n tokens occurred before, the tokens that followed them.

The drafts are those of vLLM's `ngram` speculative method (vllm/v1/spec_decode/ngram_proposer.py), written here
in numpy on vLLM's public behaviour rather than imported from its private matcher: of the lengths n in
[lo, hi], the longest for which the row's last n tokens occur earlier in the row (ending before its last
token, overlaps allowed), at the EARLIEST such place; the drafts are the tokens after that occurrence, at most
`room` of them and never past `max_len` (the model's context). tests/unit/test_ngram_matcher.py compares both
on random rows.

The proposer asks one length at a time, longest first, so that it knows the length of the match behind its
drafts: the longer the match, the likelier its continuation (benchmarks/ngram_replay.py), and each length has
its own acceptance estimate (measure.py).
"""

from __future__ import annotations

import numpy as np


def match_ngram(ids: np.ndarray, n: int, max_len: int, room: int) -> list[int]:
    """The tokens after the earliest earlier occurrence of the row's last n tokens ([]: none, or no room)."""
    if n < 1:
        raise ValueError(f"an n-gram has at least one token, got n={n}")
    total = len(ids)
    room = min(room, max_len - total)
    if total <= n or room < 1:
        return []
    windows = np.lib.stride_tricks.sliding_window_view(ids[: total - 1], n)  # windows[s] = ids[s : s + n]
    hits = np.flatnonzero((windows == ids[total - n :]).all(axis=1))
    if not len(hits):
        return []
    start = int(hits[0]) + n
    return [int(t) for t in ids[start : start + room]]


def longest_ngram(ids: np.ndarray, lo: int, hi: int, max_len: int, room: int) -> tuple[int, list[int]]:
    """(n, drafts): the prompt-lookup drafts for these tokens, those of vLLM's `ngram` method (the longest
    suffix match of lo..hi tokens, at its earliest place), and the length n of that match ((0, []): none).
    Asked longest first, so that the length is known: the longer the match, the likelier its continuation (on
    the served-load benchmark's greedy outputs a 4-token match's first draft was right 86% of the time, its
    eighth 48%; a 2-token match's first 37%: benchmarks/ngram_replay.py)."""
    for n in range(hi, lo - 1, -1):
        got = match_ngram(ids, n, max_len, room)
        if got:
            return n, got
    return 0, []
