"""A small Llama-family decoder (Llama, Qwen2, Qwen3, Mistral) with explicit, batched KV caches.

nano-vllm style: plain modules, weights loaded from a Hugging Face safetensors directory. The engine
needs control the Hugging Face cache classes do not give: one forward that writes new KV at a different
offset per row, RoPE at true positions while attending over a token-dropped cache, and the last queries
of the prefill (SnapKV/TOVA score the prefix with them).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .kv_cache import KVCache, RowCache
from .loader import check_model_dir

Tensor = torch.Tensor


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        """A Hugging Face config dict -> ModelConfig; ValueError naming what is missing or impossible."""
        try:
            out = cls._from_dict(cfg)
        except KeyError as e:
            raise ValueError(f"config.json lacks {e.args[0]!r}") from None
        except (TypeError, ValueError, AttributeError, ArithmeticError) as e:
            raise ValueError(f"config.json does not describe a model: {type(e).__name__}: {e}") from None
        out.check()
        return out

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """K and V of every layer for one token, at `itemsize` bytes per element."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * itemsize

    def check(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"config.json: {name} must be a positive integer, got {value!r}")
        if not isinstance(self.head_dim, int) or self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"config.json: head_dim must be an even integer >= 2, got {self.head_dim!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"config.json: num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )
        if not isinstance(self.max_position, int) or self.max_position < 1:
            raise ValueError(f"config.json: max_position_embeddings must be >= 1, got {self.max_position!r}")

    @classmethod
    def _from_dict(cls, cfg: dict) -> "ModelConfig":
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        eos = cfg.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        mtype = cfg["model_type"]
        return cls(
            model_type=mtype,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=cfg["num_attention_heads"],
            num_kv_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None,
            max_position=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", mtype == "qwen2"),
            qk_norm=mtype == "qwen3",
            eos_token_ids=eos,
        )


def rope_inv_freq(cfg: ModelConfig) -> Tensor:
    """Inverse frequencies theta^(-2i/d), with Llama-3 style frequency scaling when configured."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    sc = cfg.rope_scaling
    if sc is None:
        return inv.float()
    kind = sc.get("rope_type", sc.get("type"))
    if kind == "linear":
        return (inv / sc["factor"]).float()
    if kind == "llama3":
        factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old_ctx = sc["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old_ctx / lo, inv / factor, inv)
        mid = (wavelen <= old_ctx / lo) & (wavelen >= old_ctx / hi)
        return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled).float()
    raise ValueError(f"rope scaling {kind!r} is not supported")


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate halves: x*cos + rotate_half(x)*sin, x [B, H, q, D], cos/sin [B, 1, q, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, hk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.h, self.hk, self.d = h, hk, d
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, hk * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, hk * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, cache: RowCache, layer: int, obs: list | None, obs_window: int
    ) -> Tensor:
        b, q, _ = x.shape
        qs = self.q_proj(x).view(b, q, self.h, self.d).transpose(1, 2)
        ks = self.k_proj(x).view(b, q, self.hk, self.d).transpose(1, 2)
        vs = self.v_proj(x).view(b, q, self.hk, self.d).transpose(1, 2)
        if self.q_norm is not None:
            qs, ks = self.q_norm(qs), self.k_norm(ks)
        qs, ks = apply_rope(qs, cos, sin), apply_rope(ks, cos, sin)
        if obs is not None:
            obs.append(qs[:, :, -obs_window:].detach().clone())
        out = cache.attend(layer, qs, ks, vs)  # KVCache: SDPA; draft caches: the kernels' ops
        return self.o_proj(out.transpose(1, 2).reshape(b, q, self.h * self.d))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """Decoder-only LM. `forward` runs q new tokens per row against a RowCache (the full KVCache or a
    draft cache of vericache_connector.draft) and returns logits."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        c = self.cfg
        return KVCache(c.num_layers, batch, c.num_kv_heads, c.head_dim, capacity, self.dtype, self.device)

    @torch.inference_mode()
    def forward(
        self, input_ids: Tensor, positions: Tensor, cache: RowCache, obs_window: int = 0, last_only: bool = False
    ) -> tuple[Tensor, list[Tensor] | None]:
        """input_ids/positions [B, q]; writes KV, advances cache.lengths by q.
        Returns logits [B, q, V] (float32; only the last position if last_only) and, when obs_window>0,
        the last obs_window post-RoPE queries of every layer ([B, H, W, D] each)."""
        x, obs = self.hidden_states(input_ids, positions, cache, obs_window)
        return self.logits(x[:, -1:] if last_only else x), obs

    @torch.inference_mode()
    def hidden_states(
        self, input_ids: Tensor, positions: Tensor, cache: RowCache, obs_window: int = 0
    ) -> tuple[Tensor, list[Tensor] | None]:
        """The decoder without its head: [B, q, hidden] before the final norm (and the observation queries,
        as forward). A caller that needs logits at a few positions only (the verifier) heads just those."""
        freqs = positions[..., None].float() * self.inv_freq  # [B, q, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, q, D]
        cos, sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
        obs = [] if obs_window > 0 else None
        x = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, cache, i, obs, obs_window)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        cache.advance(input_ids.shape[1])
        return x, obs

    def logits(self, hidden: Tensor) -> Tensor:
        """The head: final norm + lm_head, float32 logits."""
        return self.lm_head(self.norm(hidden)).float()


def load_model(model_dir: str | Path, dtype: torch.dtype | None = None, device: str | None = None) -> CausalLM:
    """Load a checkpoint directory. Defaults: float32 on CPU, bfloat16 on CUDA."""
    from safetensors.torch import load_file

    path = Path(model_dir)
    cfg = ModelConfig.from_dict(check_model_dir(path))
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or (torch.bfloat16 if str(device).startswith("cuda") else torch.float32)
    gen_cfg = path / "generation_config.json"
    if gen_cfg.is_file():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        if eos is not None:
            cfg.eos_token_ids = tuple(sorted(set(cfg.eos_token_ids) | set(eos if isinstance(eos, list) else [eos])))
    with torch.device("meta"):
        model = CausalLM(cfg)
    state = {}
    for f in sorted(path.glob("*.safetensors")):
        try:
            state.update(load_file(f))
        except Exception as e:  # SafetensorError, OSError: junk or truncated file
            raise ValueError(f"{str(f)!r} is not a readable safetensors file ({type(e).__name__}: {e})") from None
    state = {k.removeprefix("model."): v for k, v in state.items()}
    if "lm_head.weight" not in state and "embed_tokens.weight" in state:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    expected = model.state_dict()
    missing = set(expected) - set(state)
    if missing:
        raise ValueError(f"{str(path)!r}: weights missing for {sorted(missing)[:5]}")
    for name, t in expected.items():
        if tuple(state[name].shape) != tuple(t.shape) or not state[name].is_floating_point():
            raise ValueError(
                f"{str(path)!r}: weight {name!r} is {state[name].dtype} {tuple(state[name].shape)}, "
                f"config.json implies a float tensor of shape {tuple(t.shape)}"
            )
    model.load_state_dict(state, strict=False, assign=True)
    model.inv_freq = rope_inv_freq(cfg)
    return model.to(device=device, dtype=dtype).eval()
