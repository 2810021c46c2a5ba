"""A tiny CausalLM's weights behind vLLM's Llama module layout (LlamaForCausalLM: model.layers[i].self_attn
.qkv_proj / o_proj / rotary_emb, mlp.gate_up_proj / down_proj, RMSNorm(x, residual), compute_logits; Qwen2's
q/k/v biases in qkv_proj and Qwen3's self_attn.q_norm / k_norm where the model has them), for
testing the proposer's draft forward over vLLM's modules without a vLLM engine. Linear layers return
(output, bias) as vLLM's do; the projections are fused (q|k|v, gate|up) as vLLM loads them."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from vericache_connector.model.causal_lm import CausalLM, apply_rope


class Linear(nn.Module):
    def __init__(self, *weights: torch.Tensor, biases: list[torch.Tensor | None] | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.cat(weights).detach().clone(), requires_grad=False)
        self.bias = None if not biases or biases[0] is None else torch.cat(biases).detach().clone()

    def forward(self, x):
        return F.linear(x, self.weight, self.bias), None


class RMSNorm(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps

    def forward(self, x, residual=None):
        if residual is not None:
            x = residual = x + residual
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        return y if residual is None else (y, residual)


class Rotary(nn.Module):
    def __init__(self, inv_freq: torch.Tensor, head_dim: int):
        super().__init__()
        self.inv_freq, self.head_dim = inv_freq, head_dim

    def forward(self, positions, q, k):
        freqs = positions[:, None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        n, d = q.shape[0], self.head_dim
        rot = [apply_rope(t.view(n, -1, d), emb.cos(), emb.sin()).reshape(n, -1) for t in (q, k)]
        return rot[0], rot[1]


class Attention(nn.Module):
    def __init__(self, attn, cfg, inv_freq):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)  # Qwen2: with biases
        self.qkv_proj = Linear(*(p.weight for p in projections), biases=[p.bias for p in projections])
        self.o_proj = Linear(attn.o_proj.weight)
        self.rotary_emb = Rotary(inv_freq, cfg.head_dim)
        if attn.q_norm is not None:  # Qwen3: per-head RMSNorm of q and k (vLLM's Qwen3Attention has them)
            self.q_norm, self.k_norm = RMSNorm(attn.q_norm), RMSNorm(attn.k_norm)


class SiluAndMul(nn.Module):
    def forward(self, gu):
        g, u = gu.chunk(2, dim=-1)
        return F.silu(g) * u


class MLP(nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.gate_up_proj = Linear(mlp.gate_proj.weight, mlp.up_proj.weight)
        self.down_proj = Linear(mlp.down_proj.weight)
        self.act_fn = SiluAndMul()

    def forward(self, x):
        gu, _ = self.gate_up_proj(x)
        out, _ = self.down_proj(self.act_fn(gu))
        return out


class Layer(nn.Module):
    def __init__(self, layer, cfg, inv_freq):
        super().__init__()
        self.self_attn = Attention(layer.self_attn, cfg, inv_freq)
        self.mlp = MLP(layer.mlp)
        self.input_layernorm = RMSNorm(layer.input_layernorm)
        self.post_attention_layernorm = RMSNorm(layer.post_attention_layernorm)


class Inner(nn.Module):
    def __init__(self, own: CausalLM):
        super().__init__()
        self.embed_tokens = own.embed_tokens
        self.layers = nn.ModuleList(Layer(ly, own.cfg, own.inv_freq) for ly in own.layers)
        self.norm = RMSNorm(own.norm)

    def embed_input_ids(self, ids):
        return self.embed_tokens(ids)


class FakeVLLMLlama(nn.Module):
    def __init__(self, own: CausalLM):
        super().__init__()
        self.model = Inner(own)
        self.lm_head = own.lm_head
        self.logits_processor = SimpleNamespace(scale=1.0, soft_cap=None, org_vocab_size=own.cfg.vocab_size)
        self.forward_calls = 0

    def compute_logits(self, hidden):
        return self.lm_head(hidden)

    def forward(self, *args, **kwargs):  # stands for vLLM's target forward (the proposer gates it)
        self.forward_calls += 1
        return None


def hf_config(own: CausalLM) -> dict:
    c = own.cfg
    return {
        "model_type": c.model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position,
    }
