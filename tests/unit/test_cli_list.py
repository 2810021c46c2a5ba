"""`vericache list`: every preset (PRESETS and EXTRA_PRESETS), once, under its kind, with what it needs beyond
the prefix's keys and values; what it says each compressor needs is what its compress() refuses without."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

from vericache_connector.cli import main
from vericache_connector.compressors import (
    EXTRA_PRESETS,
    GROUPS,
    NEED_TEXT,
    NEEDS,
    PRESETS,
    PrefixKV,
    compressor_names,
    get_compressor,
    preset_groups,
)
from vericache_connector.compressors.kvpress_bridge import kvpress_available

ALL = {**PRESETS, **EXTRA_PRESETS}


def listing() -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["list"]) == 0
    return out.getvalue()


def test_every_preset_is_listed_once_under_its_kind_with_its_needs():
    text = listing()
    groups = preset_groups()
    listed = [name for _, presets in groups for name, _ in presets]
    assert sorted(listed) == sorted(ALL) and len(listed) == len(set(listed))
    for group, presets in groups:
        assert presets and f"\n  {group}\n" in text
        block = text.split(f"\n  {group}\n")[1].split("\n\n")[0].splitlines()
        assert [line.split()[:2] for line in block] == [[name, spec] for name, spec in presets]
    lines = {line.split()[0]: line for line in text.splitlines() if line.startswith("    ")}
    for name, spec in ALL.items():
        needs = NEEDS.get(spec.partition(":")[0], ())
        assert lines[name].endswith(f"needs {', '.join(needs)}" if needs else "keys and values only") or (
            not kvpress_available() and "kvpress (NOT installed)" in lines[name]
        ), lines[name]
    for name in ("kvzip-5x", "expected-attention-4x", "adakv-ea-4x", "pyramidkv-4x", "kvquant4", "rotatekv2"):
        assert name in lines  # the presets the README advertises (issue 29)
    assert all(f"  {need}: {why}" in text for need, why in NEED_TEXT.items())


def test_every_compressor_has_one_kind():
    kinds = [name for names in GROUPS.values() for name in names]
    assert sorted(kinds) == compressor_names()
    assert set(NEEDS) <= set(compressor_names()) and {n for v in NEEDS.values() for n in v} == set(NEED_TEXT)


def prefix(queries: bool, rope: bool, tokens: bool) -> PrefixKV:
    g = torch.Generator().manual_seed(0)
    h, t, d = 2, 64, 32
    kv = [torch.randn(h, t, d, generator=g) for _ in range(4)]
    return PrefixKV(
        kv[:2],
        kv[2:],
        obs_queries=[torch.randn(2 * h, 8, d, generator=g) for _ in range(2)] if queries else None,
        token_ids=list(range(t)) if tokens else None,
        inv_freq=1.0 / 10000 ** (torch.arange(0, d, 2).float() / d) if rope else None,
    )


@pytest.mark.parametrize("name", [n for n in compressor_names() if n != "press"])
def test_a_compressor_refuses_exactly_what_it_is_listed_as_needing(name):
    needs = NEEDS.get(name, ())
    spec = next((s for s in ALL.values() if s.partition(":")[0] == name), name)
    c = get_compressor(spec)
    full = dict(queries=True, rope=True, tokens=True)
    assert c.compress(prefix(**full)).num_layers == 2
    for need, field in (("observation queries", "queries"), ("RoPE frequencies", "rope")):
        without = prefix(**{**full, field: False})
        if need in needs:
            with pytest.raises(ValueError):
                c.compress(without)
        else:
            assert c.compress(without).num_layers == 2


@pytest.mark.skipif(not kvpress_available(), reason="kvpress not installed")
def test_presses_refuse_a_prefix_without_token_ids():
    c = get_compressor("kvzip-5x")
    assert NEEDS["press"] == ("kvpress", "token ids") and c.needs_tokens
    with pytest.raises(ValueError, match="token ids"):
        c.compress(prefix(queries=True, rope=True, tokens=False))
