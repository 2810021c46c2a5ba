"""Any kvpress press as a token-dropping compressor: `press:<name>:ratio=R,...`.

    press:kvzip:ratio=5                      KVzip (query-agnostic: scores by context reconstruction)
    press:expected_attention:ratio=4         ExpectedAttention (query-agnostic: expected future queries)
    press:expected_attention:ratio=4,adaptive=1   the same wrapped in AdaKV: per-head budgets
    press:snapkv:ratio=4,options=window_size=32;kernel_size=7   press fields after `options=`, `;`-separated

ratio = prompt tokens / kept tokens per head (kvpress's compression_ratio = 1 - 1/ratio; the kept count
is kvpress's own compute_n_kept). kvpress runs the checkpoint as a transformers model on the prompt's
token ids (PrefixKV.token_ids) to learn which positions each head keeps (kvpress_bridge.py); the copy
stores OUR prefill's keys (post-RoPE at their true positions) and values at those positions, so tokens
generated later get their true positions as with every token-dropping compressor (dropping.py).

Layout: "uniform" (k/v [H, n, D], idx [H, n], as dropping.py) for presses that keep the same count in
every head of every layer (a ScorerPress with its compress unchanged); "heads" (heads.py: counts per
head, packed) for presses whose budgets vary by head or layer (AdaKV, KVzip, PyramidKV). The layout
depends only on the spec, so a stored copy can be validated without re-running the press.

`model` names the checkpoint directory ("" = the bundled model, engine.resolve_model_dir(None)); it must
be the checkpoint the engine prefilled with.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from . import kvpress_bridge as kb
from .base import Compressor, LayeredKV, PrefixKV
from .heads import check_layer, pack_heads, uniform_layer, unpack_heads

Tensor = torch.Tensor


def parse_options(options: str, press_cls: type) -> dict:
    """'window_size=32;kernel_size=7' -> kwargs for press_cls, typed by its dataclass fields."""
    fields = {f.name: f for f in dataclasses.fields(press_cls)}
    out = {}
    for item in filter(None, options.split(";")):
        key, eq, raw = item.partition("=")
        if not eq or key not in fields or key in ("compression_ratio", "press"):
            allowed = sorted(set(fields) - {"compression_ratio", "press"})
            raise ValueError(f"bad press option {item!r} for {press_cls.__name__}; it takes {allowed}")
        default = fields[key].default
        try:
            if isinstance(default, bool):
                out[key] = raw.lower() in ("1", "true", "yes")
            elif isinstance(default, int):
                out[key] = int(raw)
            elif isinstance(default, float):
                out[key] = float(raw)
            else:
                out[key] = raw
        except ValueError:
            raise ValueError(f"bad value {raw!r} for press option {key!r}") from None
    return out


@dataclass
class PressCompressor(Compressor):
    name = "press"
    press: str = "expected_attention"
    ratio: float = 4.0
    adaptive: bool = False  # wrap in AdaKV (per-head budgets over the layer, alpha of it guaranteed per head)
    alpha: float = 0.2  # AdaKV's alpha_safeguard
    options: str = ""  # further fields of the press: "name=value;name=value"
    model: str = ""  # checkpoint directory; "" = the bundled model

    def __post_init__(self):
        if not (isinstance(self.ratio, (int, float)) and math.isfinite(self.ratio) and self.ratio >= 1):
            raise ValueError(f"press: ratio must be a number >= 1 (1 = keep all), got {self.ratio!r}")
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"press: alpha must be in [0, 1], got {self.alpha!r}")
        cls = kb.press_class(self.press)
        scorer = kb.kvpress_module("presses.scorer_press").ScorerPress
        if self.adaptive and not issubclass(cls, scorer):
            raise ValueError(f"press: adaptive (AdaKV) needs a scorer press, {self.press!r} is not one")
        if "compression_ratio" not in {f.name for f in dataclasses.fields(cls)}:
            raise ValueError(f"press: {self.press!r} has no compression_ratio; it is not a token-dropping press")
        self._kwargs = parse_options(self.options, cls)
        uniform = issubclass(cls, scorer) and cls.compress is scorer.compress
        self._layout = "uniform" if uniform and not self.adaptive else "heads"

    @classmethod
    def from_spec_args(cls, args: str, spec: str) -> tuple[dict, str]:
        """'kvzip:ratio=5' -> ({'press': 'kvzip'}, 'ratio=5'): the press name may lead the settings."""
        head, colon, rest = args.partition(":")
        if colon and "=" not in head:
            return {"press": head}, rest
        if args and "=" not in args.split(",")[0]:
            return {"press": args.split(",")[0]}, ",".join(args.split(",")[1:])
        return {}, args

    @property
    def needs_tokens(self) -> bool:
        return True

    @property
    def layout(self) -> str:
        return self._layout

    @property
    def compression_ratio(self) -> float:
        return 1.0 - 1.0 / self.ratio

    def keep_count(self, num_tokens: int) -> int:
        """Kept positions per head (kvpress's compute_n_kept); per-head layouts keep this on AVERAGE."""
        if self.ratio == 1:
            return num_tokens
        return kb.compute_n_kept(num_tokens, self.compression_ratio)

    def make_press(self):
        cls = kb.press_class(self.press)
        press = cls(compression_ratio=self.compression_ratio, **self._kwargs)
        if self.adaptive:
            press = kb.press_class("adakv")(press=press, alpha_safeguard=self.alpha)
        return press

    def model_dir(self) -> str:
        if self.model:
            return self.model
        from ..model.loader import resolve_model_dir

        return str(resolve_model_dir(None))

    @property
    def is_kvzip(self) -> bool:
        return kb.press_class(self.press).__name__ == "KVzipPress"

    def kept(self, token_ids: list[int]) -> list[Tensor]:
        """Per layer the kept mask [H_kv, T] (bool) the press chooses for these tokens."""
        if self.ratio == 1:
            raise ValueError("press: ratio=1 keeps everything; there is nothing to run")
        return press_masks([self], token_ids)[0]

    def compress(self, prefix: PrefixKV) -> LayeredKV:
        return compress_many([self], prefix)[0]

    def from_masks(self, prefix: PrefixKV, masks: list[Tensor]) -> LayeredKV:
        """The compressed copy keeping, in each layer and KV head, the positions set in masks[layer]."""
        t, h = prefix.num_tokens, prefix.keys[0].shape[0]
        if len(masks) != prefix.num_layers or masks[0].shape != (h, t):
            raise ValueError(
                f"press model {self.model_dir()!r} gives {len(masks)} layers x {tuple(masks[0].shape)}, "
                f"the prefix {prefix.num_layers} x {(h, t)}: not the checkpoint the engine prefilled with"
            )
        layers = []
        for k, v, keep in zip(prefix.keys, prefix.values, masks):
            keep = keep.to(k.device)
            if self._layout == "uniform":
                counts = keep.sum(-1)
                if bool((counts != self.keep_count(t)).any()):
                    raise ValueError(
                        f"press {self.press!r} kept {counts.tolist()} per head, expected {self.keep_count(t)}"
                    )
                layers.append(uniform_layer(k, v, keep))
            else:
                layers.append(pack_heads(k, v, keep))
        meta = {"compressor": self.name, "num_tokens": t, "keep": self.keep_count(t), "layout": self._layout}
        return LayeredKV(self.spec, meta, layers)

    @staticmethod
    def decode(meta: dict, tensors: dict[str, Tensor], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        if meta.get("layout") == "heads":
            k, v, lengths = unpack_heads(tensors, dtype)
            if bool((lengths != k.shape[1]).any()):
                raise ValueError(
                    "per-head budgets: heads keep different counts; attend with compressors.heads.head_kv "
                    "(and each head's length) or a draft cache (vericache_connector.draft handles them)"
                )
            return k, v
        return tensors["k"].to(dtype), tensors["v"].to(dtype)

    def validate(self, compressed, num_tokens: int, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        """As Compressor.validate, without running the press: the layout is fixed by the spec."""
        if not isinstance(compressed, LayeredKV):
            raise ValueError(f"compressed copy is a {type(compressed).__name__}, expected LayeredKV")
        if compressed.spec != self.spec:
            raise ValueError(f"compressed copy has spec {compressed.spec!r}, expected {self.spec!r}")
        if not isinstance(num_tokens, int) or num_tokens < 1:
            raise ValueError(f"a compressed copy covers >= 1 token, got num_tokens={num_tokens!r}")
        keep = self.keep_count(num_tokens)
        meta = {"compressor": self.name, "num_tokens": num_tokens, "keep": keep, "layout": self._layout}
        if compressed.meta != meta:
            raise ValueError(f"compressed copy's meta {compressed.meta!r} does not match {meta!r}")
        if compressed.num_layers != num_layers:
            raise ValueError(f"compressed copy has {compressed.num_layers} layers, the model {num_layers}")
        for i, layer in enumerate(compressed.layers):
            check_layer(i, layer, self._layout, keep, num_tokens, num_kv_heads, head_dim)


def press_masks(compressors: list[PressCompressor], token_ids: list[int]) -> list[list[Tensor] | None]:
    """Kept masks of several press compressors on one prompt with as few model runs as possible: all
    hook presses of a checkpoint share one prefill, KVzip runs once per setting for all its ratios.
    None for ratio 1 (keeps everything; nothing is run)."""
    ids = list(token_ids)
    out: list[list[Tensor] | None] = [None] * len(compressors)
    groups: dict[tuple, list[int]] = {}
    for i, c in enumerate(compressors):
        if c.ratio != 1:
            key = (c.model_dir(), "kvzip", c.options) if c.is_kvzip else (c.model_dir(), "hook")
            groups.setdefault(key, []).append(i)
    for key, members in groups.items():
        model = kb.hf_model(key[0])
        if key[1] == "hook":
            masks = kb.hook_masks([compressors[i].make_press() for i in members], model, ids)
        else:
            ratios = [compressors[i].compression_ratio for i in members]
            masks = kb.kvzip_masks(compressors[members[0]].make_press(), ratios, model, ids)
        for i, m in zip(members, masks):
            out[i] = m
    return out


def compress_many(compressors: list[PressCompressor], prefix: PrefixKV) -> list[LayeredKV]:
    """Each compressor's copy of one prefix (press_masks: shared model runs)."""
    if prefix.token_ids is None:
        raise ValueError("press compressors need the prompt's token ids (PrefixKV.token_ids)")
    t = prefix.num_tokens
    if len(prefix.token_ids) != t:
        raise ValueError(f"PrefixKV has {t} tokens but {len(prefix.token_ids)} token ids")
    everything = [torch.ones(k.shape[0], t, dtype=torch.bool) for k in prefix.keys]
    masks = press_masks(compressors, prefix.token_ids)
    return [c.from_masks(prefix, everything if m is None else m) for c, m in zip(compressors, masks)]


COMPRESSOR = PressCompressor
