"""The compressors added for the paper's drafters on the real model (SmolLM2-135M) and real prompts:
kvpress presses (KVzip, ExpectedAttention, AdaKV per-head budgets, PyramidKV), KVQuant-style and
RotateKV-style quantizers. VeriCache's greedy output must equal plain full-KV greedy decoding token for
token, on the shortest bundled prompt (graphlib_py, a code continuation, 1.9k tokens), whose prefill and
full-KV greedy reference are the session's (tests/conftest.py): nothing is prefilled or decoded on the full
KV here. (The chat prompts were checked too when these compressors landed; on the 2-core CI machine a
KVzip run over a 4.7k-token chat prompt alone cost minutes, so the suite keeps the shared prompt.)

Cost (2-core CI): the presses run once for all specs (compress_many: one shared prefill for the hook
presses, one KVzip run); one preset per method (the other ratios / bit widths take the same
code paths: tests/unit/test_press*.py, test_quant.py check them on a tiny model)."""

import press_fixtures
import pytest
import torch

from vericache_connector.compressors import get_compressor
from vericache_connector.compressors.heads import is_per_head
from vericache_connector.compressors.kvpress_bridge import kvpress_available
from vericache_connector.compressors.press import PressCompressor
from vericache_connector.engine import DecodeConfig

from paths import load_benchmark

NEW = 32
PRESS = ["kvzip-5x", "expected-attention-4x", "adakv-ea-4x", "pyramidkv-4x"]
QUANT = ["kvquant4", "rotatekv2"]
ORACLE_K = 25  # largest horizon of the oracle check (it needs NEW + ORACLE_K reference tokens)
needs_kvpress = pytest.mark.skipif(not kvpress_available(), reason="kvpress not installed")


@pytest.fixture(scope="module")
def long_refs(prefills, reference):
    """(prefills, full-KV greedy outputs of >= NEW + ORACLE_K tokens): graphlib_py, the session's prefill and
    reference (64 tokens)."""
    assert len(reference[0]) >= NEW + ORACLE_K
    return [prefills[0]], [reference[0]]


@pytest.fixture(scope="module")
def mixed(long_refs):
    """(prefills, full-KV greedy outputs of NEW tokens): greedy's first NEW tokens do not depend on how
    many follow."""
    pre, refs = long_refs
    return pre, [r[:NEW] for r in refs]


@pytest.fixture(scope="module")
def press_copies(mixed, prefills, tmp_path_factory):
    """Every press compressor's copy of the prompt, from the run's shared press masks (one shared prefill for the
    hook presses and one KVzip run per test run: tests/support/press_fixtures.py, also the serving tests')."""
    pre, _ = mixed
    assert pre[0] is prefills[0] and set(PRESS) <= set(press_fixtures.PRESS)
    masks = press_fixtures.graphlib_press_masks(prefills, tmp_path_factory)
    return {s: [get_compressor(s).from_masks(pre[0].prefix, masks[s])] for s in PRESS}


def check_exact(engine, mixed, copies, spec):
    pre, reference = mixed
    cfg = DecodeConfig(max_new_tokens=NEW, draft_k=8, stop_at_eos=False)
    outs, stats = engine.generate(pre, copies, cfg)
    for i, (out, ref) in enumerate(zip(outs, reference)):
        assert out == ref, (
            f"{spec}: prompt {i} differs from full-KV greedy at token "
            f"{next(j for j, (a, b) in enumerate(zip(out, ref)) if a != b)}"
        )
    return stats


@needs_kvpress
@pytest.mark.parametrize("spec", PRESS)
def test_press_drafts_are_exact(engine, mixed, press_copies, spec):
    comp = get_compressor(spec)
    copies = press_copies[spec]
    cfg = engine.model.cfg
    for p, c in zip(mixed[0], copies):
        comp.validate(c, p.num_tokens, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        assert is_per_head(c) == (comp.layout == "heads")
        assert c.nbytes < 0.3 * p.prefix.nbytes
    stats = check_exact(engine, mixed, copies, spec)
    assert sum(map(sum, stats.accepted)) > 0


@needs_kvpress
def test_kvzip_budgets_vary_by_head_and_keep_the_sinks(mixed, press_copies):
    p, c = mixed[0][0], press_copies["kvzip-5x"][0]
    counts = torch.stack([layer["counts"] for layer in c.layers]).long()  # [L, H]
    assert counts.unique().numel() > 3  # per head and per layer
    assert int(counts.sum()) == pytest.approx(p.num_tokens * counts.numel() / 5, rel=0.01)
    for layer in c.layers:  # kvpress never evicts the first n_sink = 4 positions
        heads = torch.split(layer["idx"], layer["counts"].tolist())
        assert all(h[:4].tolist() == [0, 1, 2, 3] for h in heads)


@pytest.mark.parametrize("spec", QUANT)
def test_quantizer_drafts_are_exact(engine, mixed, spec):
    comp = get_compressor(spec)
    copies = [comp.compress(p.prefix) for p in mixed[0]]
    cfg = engine.model.cfg
    for p, c in zip(mixed[0], copies):
        comp.validate(c, p.num_tokens, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    stats = check_exact(engine, mixed, copies, spec)
    assert sum(map(sum, stats.accepted)) > 0


@needs_kvpress
def test_oracle_traces_equal_real_decoding(engine, long_refs, press_copies):
    """benchmarks/acceptance.py's derived per-round counts against real decoding, real model, on a
    per-head (AdaKV) copy of graphlib_py."""
    oracle = load_benchmark("acceptance_oracle")
    p, ref, c = long_refs[0][0], long_refs[1][0], press_copies["adakv-ea-4x"][0]
    orc = oracle.Oracle(engine, p, c, ref, oracle.exact_cache(engine, p, ref), ORACLE_K)
    for k in (8, ORACLE_K):
        cfg = DecodeConfig(max_new_tokens=NEW, draft_k=k, k_min=1, k_max=k, stop_at_eos=False)
        outs, stats = engine.generate([p], [c], cfg)
        assert outs[0] == ref[:NEW]
        assert stats.accepted[0] == oracle.derive_trace(orc, k, NEW)[0]


def test_press_presets_name_press_compressors():
    for spec in PRESS:
        assert isinstance(get_compressor(spec), PressCompressor)
