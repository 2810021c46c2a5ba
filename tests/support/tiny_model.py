"""A tiny random-weight Llama (2 layers, vocab 256) wrapped in a VeriCacheEngine: fast tests of the
engine's machinery, where exactness against its own full-KV decoding is what is checked."""

from __future__ import annotations

import torch

from vericache_connector.engine import VeriCacheEngine
from vericache_connector.model.causal_lm import CausalLM, ModelConfig

# tiny_config() as a Hugging Face config.json says it (for tests that write checkpoint folders)
TINY_HF_CONFIG = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}


def tiny_config(**overrides) -> ModelConfig:
    cfg = dict(
        model_type="llama",
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position=4096,
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=False,
        eos_token_ids=(),
    )
    return ModelConfig(**{**cfg, **overrides})


def tiny_engine(seed: int = 0, **overrides) -> VeriCacheEngine:
    torch.manual_seed(seed)
    model = CausalLM(tiny_config(**overrides))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.08)
    return VeriCacheEngine(model.eval())
