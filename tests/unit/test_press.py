"""kvpress presses as compressors (compressors/press.py, kvpress_bridge.py) on a tiny random Llama
saved as a Hugging Face checkpoint, loaded by both transformers (for the presses) and our engine.

Checks: the bridge's one shared prefill picks exactly the positions each press picks in its own
kvpress run (`with press(model)`, the way kvpress is used); the stored copy holds our prefill's keys at
those positions; VeriCache decodes exactly on every press; specs round-trip; bad settings name the value.
Skipped when kvpress is not installed (pip install --no-deps kvpress==0.5.5)."""

import pytest
import torch

pytest.importorskip("transformers")
from vericache_connector.compressors import LayeredKV, get_compressor  # noqa: E402
from vericache_connector.compressors import kvpress_bridge as kb  # noqa: E402
from vericache_connector.compressors.heads import is_per_head  # noqa: E402
from vericache_connector.engine import DecodeConfig, VeriCacheEngine  # noqa: E402
from vericache_connector.model.causal_lm import load_model  # noqa: E402

pytestmark = pytest.mark.skipif(not kb.kvpress_available(), reason="kvpress not installed")

T = 160
HOOK_SPECS = [
    "press:knorm:ratio=4",
    "press:snapkv:ratio=4,options=window_size=16;kernel_size=5",
    "press:expected_attention:ratio=4,options=n_future_positions=64",
    "press:expected_attention:ratio=3,adaptive=1",
    "press:tova:ratio=8",
    "press:streaming_llm:ratio=4",
    "press:pyramidkv:ratio=2,options=window_size=8",
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.08)
    path = tmp_path_factory.mktemp("tiny-hf")
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny_engine(ckpt):
    return VeriCacheEngine(load_model(ckpt, dtype=torch.float32, device="cpu"), model_name="tiny-hf")


@pytest.fixture(scope="module")
def tiny_prefills(tiny_engine):
    g = torch.Generator().manual_seed(3)
    return [tiny_engine.prefill(torch.randint(0, 256, (t,), generator=g).tolist()) for t in (T, T - 37)]


def native_masks(press, model, ids) -> list[torch.Tensor]:
    """What kvpress itself leaves after `with press(model)`: the kept key rows of each layer's cache
    located in the uncompressed keys, minus the positions it masks."""
    from transformers import DynamicCache

    def run(cache):
        model.model(
            input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True, cache_position=torch.arange(len(ids))
        )

    full = DynamicCache(config=model.config)
    with torch.inference_mode():
        run(full)
        cache = DynamicCache(config=model.config)
        with press(model):
            run(cache)
    masks = []
    for i, layer in enumerate(model.model.layers):
        keep = torch.zeros(model.config.num_key_value_heads, len(ids), dtype=torch.bool)
        keep.scatter_(1, kb.match_rows(full.layers[i].keys[0], cache.layers[i].keys[0]), True)
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        if masked is not None:
            keep[masked[1], masked[2]] = False
            del layer.self_attn.masked_key_indices
        masks.append(keep)
    return masks


def test_shared_prefill_matches_each_press_run_the_kvpress_way(ckpt, tiny_prefills):
    comps = [get_compressor(s.replace("ratio", f"model={ckpt},ratio")) for s in HOOK_SPECS]
    model = kb.hf_model(ckpt)
    ids = tiny_prefills[0].prompt_ids
    shared = kb.hook_masks([c.make_press() for c in comps], model, ids)
    for spec, c, got in zip(HOOK_SPECS, comps, shared):
        want = native_masks(c.make_press(), model, ids)
        for layer, (g, w) in enumerate(zip(got, want)):
            assert torch.equal(g, w), f"{spec} layer {layer}"
        counts = torch.stack([m.sum(-1) for m in got])  # [L, H]
        if c.layout == "uniform":
            assert bool((counts == c.keep_count(T)).all()), spec
        else:
            assert int(counts.sum()) == pytest.approx(c.keep_count(T) * counts.numel(), rel=0.05), spec


def test_copy_holds_our_kv_at_kept_positions_and_validates(ckpt, tiny_engine, tiny_prefills):
    for spec in ("press:expected_attention:ratio=4", "press:expected_attention:ratio=4,adaptive=1"):
        c = get_compressor(spec.replace("ratio", f"model={ckpt},ratio"))
        p = tiny_prefills[0].prefix
        out = c.compress(p)
        assert isinstance(out, LayeredKV) and is_per_head(out) == (c.layout == "heads")
        c.validate(out, T, 3, 2, 32)
        masks = c.kept(tiny_prefills[0].prompt_ids)
        for layer, keep in enumerate(masks):
            t = out.layers[layer]
            if c.layout == "uniform":
                assert torch.equal(t["k"], torch.stack([p.keys[layer][h, keep[h]] for h in range(2)]))
                assert torch.equal(t["v"], torch.stack([p.values[layer][h, keep[h]] for h in range(2)]))
            else:
                assert torch.equal(t["k"], p.keys[layer][keep])  # heads packed one after another
                assert torch.equal(t["idx"].long(), keep.nonzero()[:, 1])
        assert out.nbytes == sum(x.nbytes for layer in out.layers for x in layer.values())
        bad = LayeredKV(out.spec, dict(out.meta), [dict(layer) for layer in out.layers])
        bad.layers[1]["idx"] = bad.layers[1]["idx"].flip(-1)
        with pytest.raises(ValueError, match="not increasing"):
            c.validate(bad, T, 3, 2, 32)


def test_vericache_is_exact_on_every_press(ckpt, tiny_engine, tiny_prefills):
    """One generate call per compressor over both prompts: output = plain full-KV greedy decoding."""
    cfg = DecodeConfig(max_new_tokens=24, draft_k=6, stop_at_eos=False)
    reference = tiny_engine.generate_full(tiny_prefills, cfg)
    for spec in HOOK_SPECS:
        c = get_compressor(spec.replace("ratio", f"model={ckpt},ratio"))
        outs, stats = tiny_engine.generate(tiny_prefills, [c.compress(p.prefix) for p in tiny_prefills], cfg)
        assert outs == reference, spec
        assert stats.accepted and all(stats.accepted), spec


def test_specs_round_trip_and_name_bad_values(ckpt):
    c = get_compressor("press:kvzip:ratio=5")
    assert (c.press, c.ratio, c.is_kvzip, c.layout) == ("kvzip", 5.0, True, "heads")
    assert get_compressor(c.spec) == c
    e = get_compressor(f"press:snapkv:model={ckpt},ratio=4,options=window_size=8")
    assert get_compressor(e.spec) == e and e.layout == "uniform"
    assert get_compressor("kvzip-5x") == c
    for spec, needle in [
        ("press:nosuchpress:ratio=4", "nosuchpress"),
        ("press:kvzip:ratio=0.5", "0.5"),
        ("press:kvzip:ratio=4,adaptive=1", "adaptive"),
        ("press:snapkv:ratio=4,options=windw=3", "windw"),
        ("press:snapkv:ratio=4,options=window_size=x", "'x'"),
        ("press:merging:ratio=4", "merging"),
    ]:
        with pytest.raises(ValueError, match=needle):
            get_compressor(spec)


def test_press_needs_token_ids(ckpt, tiny_prefills):
    from vericache_connector.compressors import PrefixKV

    p = tiny_prefills[0].prefix
    c = get_compressor(f"press:knorm:model={ckpt},ratio=4")
    with pytest.raises(ValueError, match="token ids"):
        c.compress(PrefixKV(p.keys, p.values))


def kvpress_scores(ckpt, ids, press, layer: int) -> torch.Tensor:
    """press.score(...) [H_kv, T] on what kvpress's hook sees at `layer` (HF model, same checkpoint)."""
    model = kb.hf_model(ckpt)
    seen = {}

    def hook(module, args, kwargs, output):
        if module.layer_idx == layer:
            cache = kwargs["past_key_values"].layers[layer]
            seen["s"] = press.score(module, kwargs["hidden_states"], cache.keys, cache.values, None, kwargs)
        return output

    attn = model.model.layers[layer].self_attn
    attn.rotary_emb = model.model.rotary_emb
    handle = attn.register_forward_hook(hook, with_kwargs=True)
    try:
        with torch.inference_mode():
            kb._prefill(model, ids)
    finally:
        handle.remove()
    return seen["s"][0].float()


def test_hand_written_twins_against_kvpress_maths(ckpt, tiny_prefills):
    """Our dependency-free SnapKV / TOVA / key-norm / StreamingLLM (compressors/*.py) against kvpress's
    score functions on the same checkpoint and prompt. Same maths where the definitions agree:
    key-norm and StreamingLLM keep the same positions; SnapKV's scores are kvpress's times W * G away
    from the pooling edges (kvpress averages over the window and the group and pools with zero padding,
    ours sums and pools without); our TOVA scores each KV group, kvpress averages all query heads, so
    ours summed over the KV heads is kvpress's times H_q."""
    from vericache_connector.compressors.knorm import KnormCompressor
    from vericache_connector.compressors.snapkv import SnapKVCompressor
    from vericache_connector.compressors.streaming_llm import StreamingLLMCompressor
    from vericache_connector.compressors.tova import TOVACompressor

    p, ids, layer = tiny_prefills[0].prefix, tiny_prefills[0].prompt_ids, 1
    w, kern, g, hq = 16, 5, 2, 4
    # key-norm and StreamingLLM: identical kept positions at the same budget (T = 160 divisible by 4)
    for ours, spec in (
        (KnormCompressor(ratio=4), "press:knorm:ratio=4"),
        (StreamingLLMCompressor(ratio=4), "press:streaming_llm:ratio=4"),
    ):
        theirs = get_compressor(spec.replace("ratio", f"model={ckpt},ratio")).compress(p)
        mine = ours.compress(p)
        for a, b in zip(mine.layers, theirs.layers):
            assert torch.equal(a["idx"], b["idx"]), spec
    # SnapKV: proportional scores on the interior positions
    snap = kb.press_class("snapkv")(compression_ratio=0.75, window_size=w, kernel_size=kern)
    theirs = kvpress_scores(ckpt, ids, snap, layer)
    mine = SnapKVCompressor(ratio=4, window=w, kernel=kern).scores(p, layer, 40)
    inner = slice(kern // 2, T - w - kern // 2)
    torch.testing.assert_close(mine[:, inner], theirs[:, inner] * w * g, rtol=2e-4, atol=1e-7)
    # TOVA: ours summed over the KV heads = kvpress's (same for every KV head) times H_q
    tova = kb.press_class("tova")(compression_ratio=0.75)
    theirs = kvpress_scores(ckpt, ids, tova, layer)
    mine = TOVACompressor(ratio=4).scores(p, layer, 40)
    torch.testing.assert_close(mine[:, :-1].sum(0), theirs[0, :-1] * hq, rtol=2e-4, atol=1e-7)
