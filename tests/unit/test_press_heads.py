"""Per-head budgets (compressors/heads.py, draft/headsplit.py) against reference attention math.

The reference is the full prefix in a plain KVCache with the dropped positions masked out per KV head
(SDPA with an explicit mask): what attending over exactly each head's kept entries means. Tiny random
model, random kept sets with different counts per head and per layer."""

import pytest
import torch
import torch.nn.functional as F

from vericache_connector.compressors import LayeredKV
from vericache_connector.compressors.heads import check_layer, head_kv, is_per_head, pack_heads, unpack_heads
from vericache_connector.draft import DraftConfig, HeadSplitCache, make_draft_cache
from vericache_connector.engine.speculative import DecodeConfig, speculative_decode
from vericache_connector.model.kv_cache import KVCache
from vericache_kernels.paged import vllm_cpu_attention_available

from tiny_model import tiny_engine

LAYOUTS = [("materialized", "auto"), ("dense", "float32")]
if vllm_cpu_attention_available("float32"):
    LAYOUTS.append(("paged", "float32"))


def random_keep(layers: int, heads: int, t: int, seed: int) -> list[torch.Tensor]:
    """Per layer a [H, T] kept mask, a different count per head and layer (at least 1 each)."""
    g = torch.Generator().manual_seed(seed)
    masks = []
    for _ in range(layers):
        keep = torch.rand(heads, t, generator=g) < torch.rand(heads, 1, generator=g).clamp(0.1, 0.9)
        keep[:, 0] = True
        masks.append(keep)
    return masks


def per_head_copy(prefix, keep) -> LayeredKV:
    meta = {"compressor": "press", "num_tokens": prefix.num_tokens, "keep": 1, "layout": "heads"}
    return LayeredKV("test", meta, [pack_heads(k, v, m) for k, v, m in zip(prefix.keys, prefix.values, keep)])


class MaskedCache(KVCache):
    """Reference: the full prefix, attention masked to each KV head's kept positions (GQA expanded)."""

    def __init__(self, model, prefixes, keeps, extra):
        c = model.cfg
        t_max = max(p.num_tokens for p in prefixes)
        super().__init__(c.num_layers, len(prefixes), c.num_kv_heads, c.head_dim, t_max + extra, model.dtype)
        self.keep = torch.ones(c.num_layers, len(prefixes), c.num_kv_heads, t_max + extra, dtype=torch.bool)
        for row, (p, keep) in enumerate(zip(prefixes, keeps)):
            self.load_row(row, p.keys, p.values)
            for layer, m in enumerate(keep):
                self.keep[layer, row, :, : p.num_tokens] = m

    def attend(self, layer, q, k, v):
        lq, g = q.shape[2], q.shape[1] // k.shape[1]
        mask = self.mask(lq)
        self.write(layer, k, v)
        k_all, v_all = self.view(layer, lq)
        heads = self.keep[layer][:, :, : k_all.shape[2]].repeat_interleave(g, 1)[:, :, None]  # [B, Hq, 1, end]
        k_all, v_all = k_all.repeat_interleave(g, 1), v_all.repeat_interleave(g, 1)
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask & heads)


@pytest.fixture(scope="module")
def setup():
    eng = tiny_engine(num_layers=3)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (t,), generator=g).tolist() for t in (48, 37)]
    pre = [eng.prefill(ids) for ids in prompts]
    keeps = [random_keep(3, 2, p.num_tokens, seed) for seed, p in enumerate(pre)]
    return eng, pre, keeps


def test_pack_unpack_round_trip_and_bytes(setup):
    _, pre, keeps = setup
    p, keep = pre[0].prefix, keeps[0][1]
    t = pack_heads(p.keys[1], p.values[1], keep)
    k, v, n = unpack_heads(t, torch.float32)
    assert n.tolist() == keep.sum(-1).tolist()
    for h in range(keep.shape[0]):
        assert torch.equal(k[h, : n[h]], p.keys[1][h, keep[h]])
        assert torch.equal(v[h, : n[h]], p.values[1][h, keep[h]])
        assert not k[h, n[h] :].any()
    n_tot, d = int(keep.sum()), p.keys[1].shape[-1]
    assert sum(x.nbytes for x in t.values()) == n_tot * (2 * d * 4 + 4) + 4 * keep.shape[0]
    check_layer(0, t, "heads", 1, p.num_tokens, 2, d)
    c = per_head_copy(p, keeps[0])
    assert is_per_head(c)
    with pytest.raises(ValueError, match="per-head budgets"):
        c.layer_kv(0, torch.float32)
    assert torch.equal(head_kv(c, 1, torch.float32)[0], k)


def test_check_layer_rejects_unsorted_and_out_of_range(setup):
    _, pre, keeps = setup
    p = pre[0].prefix
    t = pack_heads(p.keys[0], p.values[0], keeps[0][0])
    bad = dict(t, idx=t["idx"].flip(0))
    with pytest.raises(ValueError, match="not increasing"):
        check_layer(0, bad, "heads", 1, p.num_tokens, 2, p.keys[0].shape[-1])
    with pytest.raises(ValueError, match="outside"):
        check_layer(0, t, "heads", 1, 5, 2, p.keys[0].shape[-1])


@pytest.mark.parametrize("layout,dtype", LAYOUTS)
def test_headsplit_forward_matches_masked_reference(setup, layout, dtype):
    """Logits of several draft forwards (1 and 4 new tokens) on the head-split cache equal the model
    on the full prefix masked to each head's kept positions."""
    eng, pre, keeps = setup
    model = eng.model
    comp = [per_head_copy(p.prefix, keep) for p, keep in zip(pre, keeps)]
    cache = make_draft_cache(model, comp, 16, DraftConfig(layout, dtype))
    assert isinstance(cache, HeadSplitCache)
    ref = MaskedCache(model, [p.prefix for p in pre], keeps, 16)
    pos = torch.tensor([[p.num_tokens] for p in pre])
    g = torch.Generator().manual_seed(2)
    tol = 1e-4 if layout != "paged" else 1e-3
    for width in (1, 4, 1):
        x = torch.randint(0, 256, (2, width), generator=g)
        p_ids = pos + torch.arange(width)[None]
        got, _ = model(x, p_ids, cache)
        want, _ = model(x, p_ids, ref)
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        pos = pos + width


def test_speculative_decode_same_drafts_as_masked_reference(setup):
    """The whole loop (drafts, rollback, copy of exact entries) on the head-split cache accepts exactly
    what it accepts on the masked reference cache, and the output is the full-KV output."""
    eng, pre, keeps = setup
    cfg = DecodeConfig(max_new_tokens=24, draft_k=5, k_max=5, stop_at_eos=False)
    comp = [per_head_copy(p.prefix, keep) for p, keep in zip(pre, keeps)]
    extra = cfg.cache_headroom
    first = eng.first_tokens(pre, cfg)
    outs_hs, st_hs = speculative_decode(
        eng.model,
        eng.full_cache(pre, extra),
        make_draft_cache(eng.model, comp, extra, DraftConfig("materialized")),
        first,
        cfg,
    )
    outs_ref, st_ref = speculative_decode(
        eng.model, eng.full_cache(pre, extra), MaskedCache(eng.model, [p.prefix for p in pre], keeps, extra), first, cfg
    )
    assert outs_hs == outs_ref == eng.generate_full(pre, cfg)
    assert st_hs.accepted == st_ref.accepted
