"""vericache_connector/draft_weights.py: int8 weight-only linears equal their reference math on random
inputs (the CPU op's shapes and the fallback's), and VeriCache drafting with int8 / bfloat16 weights
still reproduces plain full-KV greedy decoding of the float32 model on the three shortest real prompts."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from vericache_connector.compressors import get_compressor
from vericache_connector.draft.weights import Int8Linear, make_draft_model


@pytest.mark.parametrize(
    "fan_in,fan_out,bias", [(576, 1536, False), (1536, 576, True), (100, 37, True), (63, 5, False)]
)
def test_int8_linear_matches_reference_math(fan_in, fan_out, bias):
    """fan_in % 32 == 0 runs torch._weight_int8pack_mm, the others the float fallback."""
    g = torch.Generator().manual_seed(fan_in)
    lin = nn.Linear(fan_in, fan_out, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(fan_out, fan_in, generator=g) * 0.05)
    q = Int8Linear(lin)
    w = lin.weight.detach()
    scale = w.abs().amax(1) / 127
    code = torch.round(w / scale[:, None])
    assert torch.equal(q.code.float(), code) and int(q.code.abs().max()) == 127
    assert float(((code * scale[:, None]) - w).abs().max()) <= float(scale.max()) / 2 + 1e-7
    x = torch.randn(3, 7, fan_in, generator=g)
    ref = x.bfloat16().float() @ (q.code.float() * q.scale.float()[:, None]).t()
    if bias:
        ref = ref + lin.bias.detach().bfloat16().float()
    out = q(x)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 7, fan_out)
    torch.testing.assert_close(out.float(), ref, atol=2e-2 * float(ref.abs().max()), rtol=0)


def test_draft_model_copies_and_bad_weights(engine):
    assert make_draft_model(engine.model, "model") is engine.model
    d = make_draft_model(engine.model, "int8")
    assert d is not engine.model and d.dtype == torch.bfloat16 and engine.model.dtype == torch.float32
    assert isinstance(d.layers[0].mlp.up_proj, Int8Linear) and isinstance(d.lm_head, Int8Linear)
    assert d.inv_freq.dtype == torch.float32
    assert isinstance(engine.model.lm_head, nn.Linear)  # the model itself is untouched
    with pytest.raises(ValueError, match="'int4'"):
        make_draft_model(engine.model, "int4")


@pytest.mark.slow
@pytest.mark.parametrize("weights,preset", [("int8", "kivi4"), ("int8", "snapkv-4x"), ("bfloat16", "kivi2")])
def test_identical_to_full_kv_greedy_with_cheaper_draft_weights(engine, shortest, greedy_cfg, weights, preset):
    comp = get_compressor(preset)
    draft = dataclasses.replace(engine.draft, weights=weights)
    pre, refs = shortest(3)  # 1.9k-3.1k tokens
    outs, stats = engine.generate(pre, [comp.compress(p.prefix) for p in pre], greedy_cfg, draft=draft)
    assert outs == refs
    assert stats.mean_accepted() > 1.0, f"{weights} drafts on {preset} are almost never accepted"
