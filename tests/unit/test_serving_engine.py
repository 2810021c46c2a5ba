"""The serving engine on a tiny random-weight model: continuous batching under a device budget, every row
identical to its own single-request full-KV greedy output whatever shares its batch, the budget never
passed, one reload on the link at a time, failed reloads recomputed, sampling keeping the full-KV law."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from vericache_connector.engine import DecodeConfig
from vericache_connector.engine.config import ServingConfig
from vericache_connector.engine.sequence import Request
from vericache_connector.engine.serving import ServingEngine

from tiny_model import tiny_engine

LENGTHS = (300, 451, 517, 700, 900, 1200)
NEW = (24, 40, 17, 33, 50, 29)


@pytest.fixture(scope="module")
def tiny():
    eng = tiny_engine(num_layers=8)  # enough layers for a staging ring to be a part of them
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in LENGTHS]
    refs = [
        eng.generate_full([eng.prefill(p)], DecodeConfig(max_new_tokens=n, stop_at_eos=False))[0]
        for p, n in zip(prompts, NEW)
    ]
    mc = eng.model.cfg
    demand = sum((len(p) + n) * mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * 4 for p, n in zip(prompts, NEW))
    return eng, prompts, refs, demand, {}


def trace(prompts, spacing=0.02):
    return [Request(f"r{i}", p, n, arrival_s=spacing * i, seed=i) for i, (p, n) in enumerate(zip(prompts, NEW))]


def serve(tiny, **cfg):
    eng, prompts, refs, demand, store = tiny
    frac = cfg.pop("budget", 0.5)
    cfg = ServingConfig(
        budget_bytes=None if frac is None else int(frac * demand), **{"compressor": "snapkv-4x", "k_max": 16, **cfg}
    )
    engine = ServingEngine(eng.model, cfg, store)
    rep = engine.run(trace(prompts))
    return rep, [rep.outputs()[f"r{i}"] for i in range(len(prompts))], refs


@pytest.mark.parametrize("policy,link,budget", [("full", None, 0.5), ("vericache", None, 0.2), ("vericache", 4e6, 0.2)])
def test_rows_match_their_single_request_full_kv_output(tiny, policy, link, budget):
    rep, outs, refs = serve(tiny, policy=policy, link_bytes_per_s=link, budget=budget)
    assert outs == refs
    assert rep.reload_failures == 0
    assert rep.peak_resident_bytes <= rep.budget_bytes  # the budget is never passed
    # rows joined and left mid-run: some request was admitted after another had finished
    first_finish = min(r.finished_s for r in rep.requests)
    assert any(r.admitted_s > first_finish for r in rep.requests)
    if policy == "vericache":
        assert rep.verifications > 0 and rep.mean_accepted > 0.5
        assert rep.link_max_concurrent == 1 and rep.reloaded_bytes > 0


def test_lossy_drifts_and_vericache_holds_more_rows_in_the_same_budget(tiny):
    lossy, outs, refs = serve(tiny, policy="lossy", budget=0.34)
    assert outs != refs
    full, _, _ = serve(tiny, policy="full", budget=0.34)
    veri, outs, refs = serve(tiny, policy="vericache", budget=0.34)
    assert outs == refs
    assert veri.max_concurrent > full.max_concurrent >= 1, (veri.max_concurrent, full.max_concurrent)
    assert max(full.peak_resident_bytes, veri.peak_resident_bytes) <= veri.budget_bytes


def test_reloads_never_overlap_on_the_link(tiny, monkeypatch):
    from vericache_connector.engine import host_tier

    spans = []
    orig = host_tier.Link._move

    def move(self, r):
        orig(self, r)
        spans.append((r.started_s, time_now()))

    monkeypatch.setattr(host_tier.Link, "_move", move)
    rep, outs, refs = serve(tiny, policy="vericache", link_bytes_per_s=4e6)
    assert outs == refs and len(spans) == rep.verifications
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "two reloads on the link at once"


def time_now():
    import time

    return time.perf_counter()


def test_failed_reloads_are_recomputed_and_the_output_stays_exact(tiny, monkeypatch):
    from vericache_connector.engine import host_tier

    orig_init = host_tier.Link.__init__

    def init(self, *a, **kw):
        orig_init(self, *a, **kw)
        self.fail_next = 3

    monkeypatch.setattr(host_tier.Link, "__init__", init)
    rep, outs, refs = serve(tiny, policy="vericache", link_bytes_per_s=4e6)
    assert rep.reload_failures == 3
    assert outs == refs


def test_budget_too_small_for_one_request_is_a_clear_error(tiny):
    with pytest.raises(ValueError, match="more than the whole budget"):
        serve(tiny, policy="full", budget=0.01)
    with pytest.raises(ValueError, match="policy must be one of"):
        ServingConfig(policy="fast")
    with pytest.raises(ValueError, match="temperature"):
        ServingConfig(temperature=float("nan"))


def test_sampled_rows_keep_the_full_kv_distribution():
    """Temperature 1, 600 requests of one prompt, drafting on a heavily compressed KV: the second token (the first
    drafted and verified one) follows the full-KV law. Its marginal is sum_f p1(f) p2(. | f), with p1 the prefill's
    next-token distribution and p2 the full-KV one after f, computed exactly for every f of the vocabulary."""
    from vericache_connector.compressors import get_compressor

    eng = tiny_engine(seed=3, num_layers=4)
    with torch.no_grad():
        eng.model.lm_head.weight.mul_(40.0)  # random weights give near-uniform laws: sharpen them, for power
    prompt = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(5)).tolist()
    spec = "streamingllm:ratio=8,sinks=4"
    reqs = [Request(f"s{i}", prompt, 2, seed=1000 + i) for i in range(600)]
    cfg = ServingConfig(policy="vericache", compressor=spec, temperature=1.0, k_min=1, horizon=1, k_max=4, max_rows=64)
    rep = ServingEngine(eng.model, cfg).run(reqs)
    second = torch.tensor([o[1] for o in rep.outputs().values()])
    pre = eng.prefill(prompt)
    vocab = eng.model.cfg.vocab_size
    first = torch.arange(vocab)[:, None]
    pos = torch.full((vocab, 1), 200)
    p1 = torch.softmax(pre.logits.double(), -1)
    p2 = torch.softmax(eng.model(first, pos, eng.full_cache([pre] * vocab, 2))[0][:, -1].double(), -1)
    comp = get_compressor(spec).compress(pre.prefix)
    q2 = torch.softmax(eng.model(first, pos, eng.draft_cache([comp] * vocab, 2))[0][:, -1].double(), -1)
    target, drafted = p1 @ p2, p1 @ q2
    assert 0.5 * (target - drafted).abs().sum() > 0.05, "draft too close to the target: no power"
    assert chi2(second, target) > 1e-3
    assert chi2(second, drafted) < 1e-3, "the test cannot tell the draft law from the target law"


def chi2(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.shape[0]).double()
    expected = probs * len(samples)
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


def test_every_field_is_checked_before_anything_is_allocated(tiny, monkeypatch):
    """(issue 28, 6) Bad requests and settings are ValueErrors naming the value, raised before any pool exists:
    no budget with 10**9 new tokens used to try to allocate hundreds of GB before the context check."""
    from vericache_connector.engine import block_manager

    eng, prompts, *_ = tiny

    def no_pools(*a, **kw):
        raise AssertionError("a pool was allocated before the trace was checked")

    monkeypatch.setattr(block_manager.KVPool, "__init__", no_pools)
    engine = ServingEngine(eng.model, ServingConfig(policy="full"))
    with pytest.raises(ValueError, match="1000000000 new tokens exceed the model's context"):
        engine.run([Request("big", prompts[0], 10**9)])
    with pytest.raises(ValueError, match=r"token id 256 is outside the vocabulary \[0, 256\)"):
        engine.run([Request("oov", prompts[0][:10] + [256], 4)])
    with pytest.raises(ValueError, match="request ids in a trace must be unique"):
        engine.run([Request("a", prompts[0], 4), Request("a", prompts[1], 4)])
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match=f"arrival_s must be a finite number >= 0, got {bad}"):
            Request("r", prompts[0], 4, arrival_s=bad)
    with pytest.raises(ValueError, match="prompt_ids holds -3"):
        Request("r", [1, -3], 4)
    with pytest.raises(ValueError, match="prompt_ids holds 1.5"):
        Request("r", [1, 1.5], 4)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1, got 2.5"):
        Request("r", [1], 2.5)
    with pytest.raises(ValueError, match="budget_bytes must be a positive integer or None, got nan"):
        ServingConfig(budget_bytes=float("nan"))
    with pytest.raises(ValueError, match="link_bytes_per_s must be a finite number > 0 or None, got inf"):
        ServingConfig(link_bytes_per_s=float("inf"))


@pytest.mark.parametrize("spec", ["kivi2"])
def test_packed_draft_pool_rows_match_their_full_kv_output(tiny, spec):
    """(issue 27, item 1) A quantizer's prompt stays packed (codes + scales in the packed pool, KIVI's residual and
    the emitted tokens in the draft pool), attended without decoding: every row exact, within the budget."""
    rep, outs, refs = serve(tiny, policy="vericache", compressor=spec, link_bytes_per_s=4e6, budget=0.2)
    assert outs == refs and rep.reload_failures == 0
    assert rep.peak_resident_bytes <= rep.budget_bytes and rep.mean_accepted > 1.0


def test_the_budget_counts_packed_bytes(tiny):
    """(issue 27, item 1) A packed prompt costs its codes and scales: kivi4 at 4 bits + float16 scales per
    32-token key group / 16-channel value group, KIVI's float16 residual beside it; decoded, the same prompt
    costs float16 for every token, so a budget the packed row fits can refuse the decoded one."""
    import vericache_kernels.paged_packed as PP
    from vericache_connector.engine.sequence import Sequence

    eng, prompts, *_ = tiny
    mc = eng.model.cfg
    seq = Sequence(Request("r", prompts[-1], 8))  # 1200 tokens: 1056 packed, 144 residual
    costs = {}
    for layout in ("packed", "decoded"):
        cfg = ServingConfig(policy="vericache", compressor="kivi4", draft_layout=layout, k_max=16)
        engine = ServingEngine(eng.model, cfg)
        pools = engine.layout.make([seq], engine.sizes)
        assert engine.sizes.block_bytes == {name: pool.block_bytes for name, pool in pools.items()}
        costs[layout] = engine.sizes.resident_bytes(seq, full=False)
        if layout == "packed":
            fmt = PP.PackedFormat("kivi", 4, 4, 32, 16)
            assert engine.packed == fmt and engine.draft_lens(seq) == (1056, 144)
            # per token and layer: K, V codes at 4 bits + K scale/min per 32 tokens + V scale/min per 16 channels
            per_token = mc.num_kv_heads * (mc.head_dim + 2 * 2 * mc.head_dim / 32 + 2 * 2 * mc.head_dim / 16)
            assert pools["packed"].block_bytes == mc.num_layers * 128 * per_token
            assert engine.sizes.resident_blocks(seq, full=False) == {"packed": 9, "draft": 2, "full": 1}
        else:
            assert engine.packed is None and engine.sizes.resident_blocks(seq, full=False) == {"draft": 10, "full": 1}
    f16, f32 = (mc.kv_bytes_per_token(n) * 128 for n in (2, 4))  # a draft-pool / full-pool block
    packed_block = mc.num_layers * 128 * per_token
    assert costs == {"packed": 9 * packed_block + 2 * f16 + f32, "decoded": 10 * f16 + f32}
    assert packed_block < 0.35 * f16  # 4-bit codes and their scales against float16
    budget = int(costs["packed"] * 1.02 + 3 * 2**16)
    with pytest.raises(ValueError, match="more than the whole budget"):
        ServingEngine(
            eng.model,
            ServingConfig(policy="vericache", compressor="kivi4", draft_layout="decoded", budget_bytes=budget),
        ).run([Request("r", prompts[-1], 8)])
    with pytest.raises(ValueError, match="has no packed form"):
        ServingEngine(eng.model, ServingConfig(compressor="snapkv-4x", draft_layout="packed"))
    with pytest.raises(ValueError, match="draft_layout must be one of"):
        ServingConfig(draft_layout="zip")


def test_complement_reload_moves_only_the_dropped_positions_and_stays_exact(tiny, monkeypatch):
    """(issue 27, item 2) Token dropping with its kept positions held exactly (draft pool in the model's dtype):
    a verification reloads only the dropped positions and attends [kept, reloaded, resident tail] in one pass;
    outputs identical to full KV, through injected reload failures (recomputed: the dropped positions only)."""
    from vericache_connector.engine import host_tier

    moved = []
    orig_move, orig_init = host_tier.Link._move, host_tier.Link.__init__

    def move(self, r):
        moved.append((r.entry.tokens, r.entry.stored))
        orig_move(self, r)

    def init(self, *a, **kw):
        orig_init(self, *a, **kw)
        self.fail_next = 2

    monkeypatch.setattr(host_tier.Link, "_move", move)
    monkeypatch.setattr(host_tier.Link, "__init__", init)
    rep, outs, refs = serve(
        tiny, policy="vericache", link_bytes_per_s=4e6, budget=0.3, draft_dtype="float32", reload="complement"
    )
    assert outs == refs and rep.reload_failures == 2
    assert rep.peak_resident_bytes <= rep.budget_bytes and rep.mean_accepted > 1.0
    assert moved and all(0 < n < stored for n, stored in moved if stored > 128), moved
    # snapkv-4x keeps a quarter (topped up to whole blocks): at most 3 of 4 stored blocks are dropped
    assert all(n <= stored - max(128, -(-stored // 4) // 128 * 128) for n, stored in moved if stored > 128)
    with pytest.raises(ValueError, match="draft_dtype must be the model's"):
        ServingEngine(tiny[0].model, ServingConfig(reload="complement"))
    with pytest.raises(ValueError, match="reload must be one of"):
        ServingConfig(reload="half")


@pytest.mark.parametrize("compressor", ["snapkv-4x", "kivi4"])
def test_tail_rows_go_on_on_their_full_kv_where_it_fits(tiny, compressor):
    """ServingConfig.tail_full: once nothing waits, a row whose whole full KV fits keeps the prompt its
    verification reloaded and decodes on it (no more drafts or reloads); outputs exact, the budget never passed,
    and no row switches while requests still wait. Off: every row verifies to its end."""
    rep, outs, refs = serve(tiny, policy="vericache", compressor=compressor, budget=0.5)
    assert outs == refs and rep.peak_resident_bytes <= rep.budget_bytes
    assert rep.switched_to_full >= 1
    last_admit = max(r.admitted_s for r in rep.requests)
    assert all(r.switched_s is None or r.switched_s >= last_admit for r in rep.requests)
    off, outs, _ = serve(tiny, policy="vericache", compressor=compressor, budget=0.5, tail_full=False)
    assert outs == refs and off.switched_to_full == 0

    def verified(r) -> int:  # the tokens a row got from its prefill and its verifications (accepted + 1 each)
        return 1 + sum(a + 1 for a in r.accepted)

    # a row that never switched got every token from verifications; a switched one stopped verifying and got
    # the rest one a step on its full KV (which rows switch depends on the clock, these counts do not)
    assert all(verified(r) >= r.new_tokens for r in off.requests + rep.requests if r.switched_by is None)
    assert any(verified(r) < r.new_tokens for r in rep.requests if r.switched_by == "tail")


def test_a_server_loop_drives_the_engine_by_add_request_and_step(tiny):
    """(issue 41, item 2) nano-vllm's shape: a loop adds requests while others run (add_request), steps the engine
    (step: the tokens each request emitted) until nothing is left (has_unfinished); every request's tokens are its
    full-KV greedy output, as run() gives them. The pools, made for the first request (no budget: for its demand),
    grow for the later ones."""
    eng, prompts, refs, demand, store = tiny
    cfg = ServingConfig(compressor="snapkv-4x", k_max=16, link_bytes_per_s=4e7)
    engine = ServingEngine(eng.model, cfg, store)
    order = [0, 2, 3, 5]  # the longest prompt last
    later = [Request(f"r{i}", prompts[i], NEW[i], seed=i) for i in order[1:]]
    engine.add_request(Request("r0", prompts[0], NEW[0]))
    got: dict[str, list[int]] = {}
    blocks = None
    while engine.has_unfinished() or later:
        if later and sum(map(len, got.values())) >= 4 * (4 - len(later)):  # the next one once others have emitted
            engine.add_request(later.pop(0))
        for rid, tokens in engine.step():
            got.setdefault(rid, []).extend(tokens)
        blocks = blocks or engine.pools["full"].num_blocks
    assert got == {f"r{i}": refs[i] for i in order}
    rep = engine.report()
    assert rep.outputs() == got and rep.verifications > 0
    first = {r.request_id: r for r in rep.requests}
    assert first["r5"].arrival_s > first["r0"].first_token_s  # added while r0 ran
    assert engine.pools["full"].num_blocks > blocks  # grown for the longest prompt
    ran = ServingEngine(eng.model, cfg, store).run([Request(f"r{i}", prompts[i], NEW[i], seed=i) for i in order])
    assert ran.outputs() == got
    with pytest.raises(ValueError, match="request ids in a trace must be unique"):
        engine.add_request(Request("r2", prompts[1], 4))


@pytest.mark.parametrize("compressor", ["snapkv-4x", "kivi4"])
def test_rows_that_lose_move_to_full_kv_mid_trace_and_stay_exact(tiny, compressor):
    """(issue 41, item 1) The guard: hardware figures by which full KV is far faster (planner off, so VeriCache
    starts): once the rows have verified, their measured rate is below full KV's and rows move to full KV while
    requests still wait. Every output exact, the budget never passed. Without the guard no row moves before the
    trace's tail. (Which rows run when the guard trips depends on the clock here: whether one is paused to make
    room is checked without a clock in test_moves.py.)"""
    from vericache_connector.engine.capacity import Hardware

    fast_full = Hardware("full KV far faster (test figures)", 1e15, 1e18, 1e9, 4e7)
    common = dict(policy="vericache", compressor=compressor, link_bytes_per_s=4e7, hardware=fast_full, planner=False)
    rep, outs, refs = serve(tiny, budget=0.3, **common)
    assert outs == refs and rep.peak_resident_bytes <= rep.budget_bytes and rep.reload_failures == 0
    moved = [r for r in rep.requests if r.switched_by == "guard"]
    last_admit = max(r.admitted_s for r in rep.requests)
    assert moved and min(r.switched_s for r in moved) < last_admit  # while requests still waited
    assert rep.moved_by_guard == len(moved) and rep.verifications > 0
    off, outs, _ = serve(tiny, budget=0.3, guard=False, **common)
    assert outs == refs and off.moved_by_guard == 0
    assert all(r.switched_s is None or r.switched_s >= max(q.admitted_s for q in off.requests) for r in off.requests)


def test_the_docs_server_loop_runs_as_written(tiny):
    """docs/serving.md's loop (add_request while another request runs, step, has_unfinished) as written, on the
    tiny model: each request's stream is its full-KV greedy output."""
    from doc_commands import blocks

    from paths import ROOT

    eng, prompts, refs, demand, store = tiny
    [code] = [b.text for b in blocks(ROOT / "docs" / "serving.md") if b.lang == "python"]
    ns = {"model": eng.model, "prompts": prompts, "budget": int(0.4 * demand)}
    exec(compile(code, "docs/serving.md", "exec"), ns)
    assert ns["streams"] == {"a": refs[0][:16], "b": refs[1][:16]}
    assert ns["report"].outputs() == ns["streams"]


def test_a_planner_decision_holds_for_the_requests_it_was_made_for(tiny, monkeypatch):
    """(issue 41) A budget that holds one row on full KV at a time: the engine empties after each row, and the rest
    of the trace is not re-predicted alone: one prediction for the three requests, every row admitted on full KV
    as it said (re-predicting a small tail, which the model overrates, put the last rows on VeriCache where they
    lost). A request added after the decision is decided afresh, with a prediction of its own."""
    from vericache_connector.engine import capacity
    from vericache_connector.engine.capacity import Hardware

    eng, prompts, refs, demand, store = tiny
    predicted, empties = [], []
    loss = capacity.Prediction(1, 0.1, 10.0, 1, 4, 0.1, 5.0, False)  # VeriCache / full KV = 0.5
    monkeypatch.setattr(ServingEngine, "predict", lambda self, trace: predicted.append(len(trace)) or loss)
    decide = ServingEngine._decide

    def watched(self):
        s = self.scheduler
        if not (s.running or s.prefilling or s.paused) and (s.waiting or s.arrivals):
            empties.append(self.now())
        decide(self)

    monkeypatch.setattr(ServingEngine, "_decide", watched)
    per_token = demand / sum(len(p) + n for p, n in zip(prompts, NEW))
    hw = Hardware("test figures", 1e12, 1e15, 1e9, 4e7)
    cfg = ServingConfig(
        compressor="snapkv-4x", k_max=16, link_bytes_per_s=4e7, hardware=hw, budget_bytes=int(700 * per_token)
    )
    engine = ServingEngine(eng.model, cfg, store)
    rep = engine.run([Request(f"r{i}", prompts[i], NEW[i], seed=i) for i in range(3)])
    assert rep.outputs() == {f"r{i}": refs[i] for i in range(3)}
    assert len(empties) == 3  # empty before each row ...
    assert predicted == [3]  # ... and decided once
    assert rep.served_policy == "full" and rep.verifications == 0
    predicted.clear()
    engine.add_request(Request("a", prompts[0], 4))  # a server's loop: decided, served, then a new request
    while engine.has_unfinished():
        engine.step()
    engine.add_request(Request("b", prompts[1], 4))
    while engine.has_unfinished():
        engine.step()
    assert predicted == [1, 1]


def test_the_measured_prefill_cost_feeds_the_capacity_model(tiny, monkeypatch):
    """(issue 41) What a VeriCache prefill adds (compression, packing, the host copy) is measured per row, reported
    (ServingReport.prefill_overhead_s, which benchmarks/serving.py hands the guarded run) and used by the engine's
    next predictions instead of the configured estimate; a full-KV row adds nothing to it."""
    from vericache_connector.engine import capacity
    from vericache_connector.engine.capacity import Hardware

    eng, prompts, refs, demand, store = tiny
    cfg = ServingConfig(compressor="kivi4", k_max=16, link_bytes_per_s=4e7, prefill_s=123.0)
    engine = ServingEngine(eng.model, cfg, store)
    assert engine.prefill_added_s is None
    rep = engine.run([Request(f"r{i}", prompts[i], NEW[i], seed=i) for i in range(2)])
    assert rep.outputs() == {f"r{i}": refs[i] for i in range(2)}
    assert 0 < engine.prefill_added_s < rep.split.prefill_s and rep.prefill_overhead_s == engine.prefill_added_s
    seen = []
    orig = capacity.for_trace
    monkeypatch.setattr(capacity, "for_trace", lambda *a, **k: seen.append(k["prefill_s"]) or orig(*a, **k))
    engine.cfg = ServingConfig(**{**cfg.__dict__, "hardware": Hardware("test figures", 1e12, 1e15, 1e9, 4e7)})
    engine.predict([Request("x", prompts[0], 8)])
    assert seen == [engine.prefill_added_s]
    full = ServingEngine(eng.model, ServingConfig(policy="full"), store)
    full.run([Request("r0", prompts[0], 4)])
    assert full.prefill_added_s is None
