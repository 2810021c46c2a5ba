"""VeriCacheEngine: prefill, compress, and decode three ways (full KV, lossy compressed, VeriCache).

    engine = VeriCacheEngine.from_pretrained()             # bundled SmolLM2-135M, float32 on CPU
    pre = [engine.prefill(ids) for ids in prompts]         # full KV + observation queries
    comp = [get_compressor("kivi4").compress(p.prefix) for p in pre]
    outs, stats = engine.generate(pre, comp, DecodeConfig(max_new_tokens=64, draft_k=8))

How drafts are held and computed (DraftConfig) is an argument of each call; the engine's own `draft`
is only the default, fixed at construction.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..compressors import CompressedKV, PrefixKV, get_compressor
from ..draft import DraftConfig, make_draft_cache, make_draft_model
from ..model.causal_lm import CausalLM, load_model
from ..model.kv_cache import KVCache, RowCache
from ..model.loader import memory_identity, model_identity, resolve_model_dir
from ..model.sampling import sample
from .speculative import DecodeConfig, SpecStats, autoregressive_decode, speculative_decode

Tensor = torch.Tensor


@dataclass
class Prefill:
    """One prompt after prefill: its exact KV (with observation queries) and last-position logits."""

    prompt_ids: list[int]
    prefix: PrefixKV
    logits: Tensor  # [V] float32, predicts the first generated token

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids)


class VeriCacheEngine:
    def __init__(
        self,
        model: CausalLM,
        tokenizer=None,
        obs_window: int = 32,
        model_name: str | None = None,
        draft: DraftConfig | None = None,
    ):
        self.model, self.tokenizer, self.obs_window = model, tokenizer, obs_window
        self._model_name = model_name
        self.draft = draft or DraftConfig()  # how draft caches hold and attend the compressed prefix
        self._draft_models: dict[str, CausalLM] = {}

    @property
    def model_name(self) -> str:
        """Names the model in store keys and manifests: 'name.fingerprint', where the fingerprint covers
        what determines the KV (config, weights, tokenizer, dtype), so two checkpoints never share
        entries. from_pretrained fingerprints the checkpoint's files; an engine built around a model
        object without a name fingerprints the weights in memory (once, on first use)."""
        if self._model_name is None:
            self._model_name = memory_identity(self.model)
        return self._model_name

    @classmethod
    def from_pretrained(
        cls,
        model: str | Path | None = None,
        dtype: torch.dtype | None = None,
        device: str | None = None,
        draft: DraftConfig | None = None,
    ) -> "VeriCacheEngine":
        from transformers import AutoTokenizer

        path = resolve_model_dir(model)
        net = load_model(path, dtype=dtype, device=device)
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError, KeyError, TypeError) as e:  # no or broken tokenizer files
            raise ValueError(f"{str(path)!r}: the tokenizer does not load ({type(e).__name__}: {e})") from None
        return cls(net, tokenizer, model_name=model_identity(path, net.dtype), draft=draft)

    @property
    def max_context(self) -> int:
        return self.model.cfg.max_position

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"prompt is empty: {text!r}")
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def check_length(self, num_prompt: int, max_new: int) -> None:
        if num_prompt == 0:
            raise ValueError("prompt is empty (0 tokens)")
        if num_prompt + max_new > self.max_context:
            raise ValueError(
                f"prompt of {num_prompt} tokens + {max_new} new tokens exceeds the model's "
                f"context of {self.max_context} tokens"
            )

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int]) -> Prefill:
        """Run the prompt through the full model once; keep its KV and last `obs_window` queries."""
        self.check_length(len(prompt_ids), 0)
        t = len(prompt_ids)
        cache = self.model.new_cache(1, t)
        ids = torch.tensor([prompt_ids], device=self.model.device)
        logits, obs = self.model(
            ids, torch.arange(t, device=ids.device)[None], cache, obs_window=min(self.obs_window, t), last_only=True
        )
        prefix = PrefixKV(
            keys=[k[0] for k in cache.keys],
            values=[v[0] for v in cache.values],
            obs_queries=[o[0] for o in obs],
            token_ids=list(prompt_ids),  # kvpress presses re-run the model on them (compressors/press.py)
            inv_freq=self.model.inv_freq.float().cpu(),  # pre-RoPE quantizers undo RoPE (compressors/kvquant.py)
        )
        return Prefill(list(prompt_ids), prefix, logits[0, -1])

    # ---- caches -------------------------------------------------------------------------------
    def full_cache(self, prefills: list[Prefill], extra: int) -> KVCache:
        cache = self.model.new_cache(len(prefills), max(p.num_tokens for p in prefills) + extra)
        for row, p in enumerate(prefills):
            cache.load_row(row, p.prefix.keys, p.prefix.values)
        return cache

    def draft_model(self, config: DraftConfig | None = None) -> CausalLM:
        """The model draft steps run (config.weights: the model itself, or a cheaper copy, made once)."""
        weights = (config or self.draft).weights
        if weights not in self._draft_models:
            self._draft_models[weights] = make_draft_model(self.model, weights)
        return self._draft_models[weights]

    def draft_cache(self, compressed: list[CompressedKV], extra: int, config: DraftConfig | None = None) -> RowCache:
        """The cache drafts attend over, one compressed prefix per row, room for `extra` new entries.
        config (default self.draft) picks the layout: the compressed prefix kept compact (packed codes
        for the Triton kernels on CUDA, float16 through the fused CPU kernel on the CPU) or
        "materialized" into a plain KVCache in the model's dtype (see vericache_connector.draft)."""
        config = config or self.draft
        return make_draft_cache(self.draft_model(config), compressed, extra, config)

    def first_tokens(self, prefills: list[Prefill], cfg: DecodeConfig) -> Tensor:
        return sample(torch.stack([p.logits for p in prefills]), cfg.temperature, cfg.generator())[0]

    # ---- the three decoders -------------------------------------------------------------------
    def generate_full(self, prefills: list[Prefill], cfg: DecodeConfig, on_tokens=None) -> list[list[int]]:
        """Reference: plain autoregressive decoding over the full KV."""
        for p in prefills:
            self.check_length(p.num_tokens, cfg.max_new_tokens)
        cache = self.full_cache(prefills, cfg.max_new_tokens + 1)
        return autoregressive_decode(
            self.model, cache, self.first_tokens(prefills, cfg), cache.lengths.clone(), cfg, on_tokens
        )

    def generate_lossy(
        self,
        prefills: list[Prefill],
        compressed: list[CompressedKV],
        cfg: DecodeConfig,
        on_tokens=None,
        draft: DraftConfig | None = None,
    ) -> list[list[int]]:
        """What plain KV compression gives: decoding on the compressed KV only (drifts from full KV).
        draft: how the compressed cache is held (its weights are not used: this decodes with the model)."""
        cache = make_draft_cache(self.model, compressed, cfg.max_new_tokens + 1, draft or self.draft)
        positions = torch.tensor([p.num_tokens for p in prefills], device=self.model.device)
        return autoregressive_decode(self.model, cache, self.first_tokens(prefills, cfg), positions, cfg, on_tokens)

    def warm_up(self, compressor: str | None = None) -> float:
        """Run the paths a server uses once on a short prompt (prefill and plain decoding; with `compressor`
        also a compressed copy, its draft cache and draft / verify forwards), so that its first request does
        not pay the one-time costs (lazy kernel imports, allocator growth: about 1.5 s for the first paged
        draft cache on the CPU). Returns the seconds it took."""
        t0 = time.perf_counter()
        pre = self.prefill(list(range(1, 65)))
        cfg = DecodeConfig(max_new_tokens=4, draft_k=2)
        if compressor is not None:  # a drafter; the verifier runs only full-KV forwards
            self.generate([pre], [get_compressor(compressor).compress(pre.prefix)], cfg)
        self.generate_full([pre], cfg)
        return time.perf_counter() - t0

    def generate(
        self,
        prefills: list[Prefill],
        compressed: list[CompressedKV],
        cfg: DecodeConfig,
        on_tokens=None,
        draft: DraftConfig | None = None,
    ) -> tuple[list[list[int]], SpecStats]:
        """VeriCache: draft on `compressed`, verify on the full KV; output = full-KV output.
        draft: how drafts are held and computed (default: the engine's DraftConfig)."""
        if len(prefills) != len(compressed):
            raise ValueError(f"{len(prefills)} prefills but {len(compressed)} compressed caches")
        for p in prefills:
            self.check_length(p.num_tokens, cfg.max_new_tokens)
        draft = draft or self.draft
        extra = cfg.cache_headroom
        full = self.full_cache(prefills, extra)
        cache = self.draft_cache(compressed, extra, draft)
        return speculative_decode(
            self.model,
            full,
            cache,
            self.first_tokens(prefills, cfg),
            cfg,
            on_tokens,
            draft_model=self.draft_model(draft),
        )
