"""Our Llama-family forward against Hugging Face transformers, and the batched KV cache's bookkeeping."""

from __future__ import annotations

import pytest
import torch

from vericache_connector.model.causal_lm import load_model


def hf_logits(model_dir, ids):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return hf(ids).logits


def prefill_then_decode(model, ids, split):
    cache = model.new_cache(1, ids.shape[1] + 1)
    a, _ = model(ids[:, :split], torch.arange(split)[None], cache)
    b, _ = model(ids[:, split:], torch.arange(split, ids.shape[1])[None], cache)
    return torch.cat([a, b], 1)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "llama"])
def test_matches_transformers_on_tiny_random_checkpoints(tmp_path, model_type):
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = (
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        }
        if model_type == "llama"
        else {}
    )
    cfg = AutoConfig.for_model(
        model_type,
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        **extra,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    ids = torch.randint(0, 300, (1, 150))
    ref = hf_logits(tmp_path, ids)
    ours = prefill_then_decode(load_model(tmp_path, device="cpu"), ids, 140)
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


@pytest.mark.slow
def test_matches_transformers_on_smollm2(engine):
    from vericache_connector.data import load_prompt
    from vericache_connector.model.loader import resolve_model_dir

    ids = torch.tensor([engine.encode(load_prompt("graphlib_py"))[:400]])
    ref = hf_logits(resolve_model_dir(None), ids)
    ours = prefill_then_decode(engine.model, ids, 390)
    torch.testing.assert_close(ours, ref, atol=2e-3, rtol=1e-3)
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.99


@pytest.mark.slow
def test_ragged_batch_rows_equal_single_rows(engine):
    """Rows of different lengths in one batch give each row's own single-row result."""
    m = engine.model
    g = torch.Generator().manual_seed(0)
    lens = [37, 90, 64]
    prompts = [torch.randint(0, 49152, (n,), generator=g) for n in lens]
    caches = []
    for p in prompts:
        c = m.new_cache(1, 200)
        m(p[None], torch.arange(len(p))[None], c)
        caches.append(c)
    batch = m.new_cache(3, 200)
    for row, c in enumerate(caches):
        n = int(c.lengths[0])
        batch.load_row(row, [k[0, :, :n] for k in c.keys], [v[0, :, :n] for v in c.values])
    new = torch.randint(0, 49152, (3, 4), generator=g)
    pos = torch.tensor(lens)[:, None] + torch.arange(4)[None]
    out_b, _ = m(new, pos, batch)
    for row, c in enumerate(caches):
        out_s, _ = m(new[row : row + 1], pos[row : row + 1], c)
        torch.testing.assert_close(out_b[row], out_s[0], atol=1e-4, rtol=1e-4)
    assert batch.lengths.tolist() == [n + 4 for n in lens]


def test_not_a_model_dir(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(ValueError, match="'bert'"):
        load_model(tmp_path)
