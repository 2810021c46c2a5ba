"""Compressor registry: one compressor per file, a dataclass each, registered by name.

``get_compressor("snapkv:ratio=8,window=32")`` or a preset name (``"kivi4"``, ``"snapkv-4x"``) gives a
configured compressor; unknown names and impossible settings raise ValueError naming the bad value.
"""

from __future__ import annotations

import dataclasses
import importlib

from .base import CompressedKV, Compressor, LayeredKV, PrefixKV

_MODULES = {
    "streamingllm": "streaming_llm",
    "snapkv": "snapkv",
    "tova": "tova",
    "knorm": "knorm",
    "kivi": "kivi",
    "int8": "int8",
    "fp8": "fp8",
    "turboquant": "turboquant",
    "press": "press",  # any kvpress press (optional dependency kvpress; press.py)
    "kvquant": "kvquant",
    "rotatekv": "rotatekv",
    "split16": "split16",
}

PRESETS = {
    "streamingllm-4x": "streamingllm:ratio=4",
    "streamingllm-8x": "streamingllm:ratio=8",
    "snapkv-4x": "snapkv:ratio=4",
    "snapkv-8x": "snapkv:ratio=8",
    "tova-4x": "tova:ratio=4",
    "knorm-4x": "knorm:ratio=4",
    "kivi4": "kivi:bits=4",
    "kivi2": "kivi:bits=2",
    "int8": "int8",
    "fp8": "fp8",
    "turboquant-k4v3": "turboquant:key_bits=4,value_bits=3",
    "turboquant-k3v2": "turboquant:key_bits=3,value_bits=2",
}

# Presets get_compressor also knows, kept out of PRESETS (which tests and benchmark grids run on any
# PrefixKV): press presets need the prompt's token ids and kvpress, kvquant the RoPE frequencies
# (PrefixKV.token_ids / inv_freq, which VeriCacheEngine.prefill fills); split16 only splits float32 KV.
EXTRA_PRESETS = {
    "kvquant4": "kvquant:bits=4",
    "kvquant2": "kvquant:bits=2",
    "rotatekv4": "rotatekv:bits=4",
    "rotatekv2": "rotatekv:bits=2",
    # lossless split of float32 KV (split16.py): its compressed copy is half of the full copy's bytes
    "split16": "split16",
    # kvpress presses (press.py); KVzip at 0.2 of the tokens is the paper's long-context drafter
    "kvzip-5x": "press:kvzip:ratio=5",
    "kvzip-4x": "press:kvzip:ratio=4",
    "kvzip-8x": "press:kvzip:ratio=8",
    "expected-attention-4x": "press:expected_attention:ratio=4",
    "expected-attention-8x": "press:expected_attention:ratio=8",
    "adakv-ea-4x": "press:expected_attention:ratio=4,adaptive=1",
    "adakv-ea-8x": "press:expected_attention:ratio=8,adaptive=1",
    "pyramidkv-4x": "press:pyramidkv:ratio=4",
}


# `vericache list`: the presets by kind, and what each compressor needs beyond the prefix's keys and values.
# Without it compress() is a ValueError naming it. VeriCacheEngine.prefill fills all of them; the stores'
# writers (the vLLM connector, the LMCache adapter, the remote cache) have the keys and values only.
GROUPS = {
    "token dropping (keep 1/N of the positions per head)": ("streamingllm", "snapkv", "tova", "knorm"),
    "quantization (every position, fewer bits)": (
        "kivi",
        "int8",
        "fp8",
        "turboquant",
        "kvquant",
        "rotatekv",
        "split16",
    ),
    "kvpress presses (NVIDIA kvpress run on the checkpoint as a transformers model; slow on a CPU)": ("press",),
}
NEEDS = {
    "snapkv": ("observation queries",),
    "tova": ("observation queries",),
    "kvquant": ("RoPE frequencies",),
    "press": ("kvpress", "token ids"),
}
NEED_TEXT = {
    "observation queries": "the prefill's last queries (PrefixKV.obs_queries)",
    "token ids": "the prompt's token ids (PrefixKV.token_ids)",
    "RoPE frequencies": "the model's RoPE frequencies (PrefixKV.inv_freq)",
    "kvpress": "kvpress installed (pip install --no-deps kvpress==0.5.5)",
}


def compressor_names() -> list[str]:
    return sorted(_MODULES)


def preset_groups() -> list[tuple[str, list[tuple[str, str]]]]:
    """[(group, [(preset, spec), ...]), ...]: every preset of PRESETS and EXTRA_PRESETS once, by GROUPS."""
    presets = {**PRESETS, **EXTRA_PRESETS}
    return [
        (group, [(k, v) for k, v in presets.items() if v.partition(":")[0] in names]) for group, names in GROUPS.items()
    ]


def compressor_class(name: str) -> type[Compressor]:
    if name not in _MODULES:
        raise ValueError(
            f"unknown compressor {name!r}; known: {', '.join(compressor_names())} "
            f"or presets {', '.join(sorted({**PRESETS, **EXTRA_PRESETS}))}"
        )
    module = importlib.import_module(f".{_MODULES[name]}", __name__)
    return module.COMPRESSOR


def _parse_value(field: dataclasses.Field, raw: str, spec: str):
    typ = field.type if isinstance(field.type, str) else field.type.__name__
    try:
        if "int" in typ:
            return int(raw)
        if "float" in typ:
            return float(raw)
        if "bool" in typ:
            return raw.lower() in ("1", "true", "yes")
    except ValueError:
        raise ValueError(f"bad value {raw!r} for {field.name!r} in compressor spec {spec!r}") from None
    return raw


def get_compressor(spec: str | Compressor) -> Compressor:
    """Build a compressor from 'name' / 'name:key=value,...' / a preset name."""
    if isinstance(spec, Compressor):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"compressor spec must be a non-empty string, got {spec!r}")
    full = PRESETS.get(spec.strip()) or EXTRA_PRESETS.get(spec.strip(), spec.strip())
    name, _, args = full.partition(":")
    cls = compressor_class(name)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    if hasattr(cls, "from_spec_args"):  # e.g. press:kvzip:ratio=5 (a name before the settings)
        kwargs, args = cls.from_spec_args(args, spec)
    for item in filter(None, args.split(",")):
        key, eq, raw = item.partition("=")
        if not eq or key not in fields:
            raise ValueError(f"bad setting {item!r} in compressor spec {spec!r}; {name} takes {sorted(fields)}")
        kwargs[key] = _parse_value(fields[key], raw, spec)
    return cls(**kwargs)


__all__ = [
    "CompressedKV",
    "Compressor",
    "LayeredKV",
    "PrefixKV",
    "PRESETS",
    "EXTRA_PRESETS",
    "GROUPS",
    "NEEDS",
    "NEED_TEXT",
    "compressor_names",
    "preset_groups",
    "compressor_class",
    "get_compressor",
]
