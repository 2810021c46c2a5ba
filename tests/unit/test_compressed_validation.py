"""A compressed copy that passed its checksums but does not fit the model or its own meta is refused by
Compressor.validate (a ValueError, never a crash later), and RemotePrefixCache treats it as a miss of
the compressed copy: it decodes from the full copy, gives the full-KV output, leaves no stream running,
and writes a good compressed copy back. The tiny random-weight model, an in-memory store."""

from __future__ import annotations

import asyncio
import logging
import uuid

import pytest
import torch

from storage_backends import DualCopyStore
from vericache_connector.compressors import PRESETS, LayeredKV, PrefixKV, get_compressor
from vericache_connector.engine import DecodeConfig
from vericache_connector.remote import RemoteCacheConfig, RemotePrefixCache

from stores import drop_memory_store, run
from tiny_model import tiny_engine

LAYERS, H_KV, D, T = 2, 2, 32, 256  # the tiny model's KV shape; T: the stored prefix (KIVI quantizes 128)
KIVI4 = get_compressor("kivi4")


def random_prefix(t: int = T, seed: int = 0) -> PrefixKV:
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(H_KV, t, D, generator=g) for _ in range(LAYERS)]
    values = [torch.randn(H_KV, t, D, generator=g) for _ in range(LAYERS)]
    return PrefixKV(keys, values, [torch.randn(4, 32, D, generator=g) for _ in range(LAYERS)])


def copy_of(c: LayeredKV, spec: str | None = None, meta: dict | None = None, layers=None) -> LayeredKV:
    """A stored copy as read back: (meta, layers) through to_payload/from_payload, with changes."""
    m, ls = c.to_payload()
    m = {**m, **(meta or {})}
    if spec is not None:
        m["spec"] = spec
    return LayeredKV.from_payload(m, [dict(x) for x in (ls if layers is None else layers)])


def validate(comp, compressor=KIVI4, t=T, layers=LAYERS):
    compressor.validate(comp, t, layers, H_KV, D)


def bad_variants() -> dict[str, tuple]:
    """name -> (meta, layers) of a payload stored under KIVI4's spec that must be refused."""
    pre = random_prefix()
    kivi4, kivi2 = KIVI4.compress(pre), get_compressor("kivi2").compress(pre)
    snap = get_compressor("snapkv-4x").compress(pre)

    def payload(c, spec=None, meta=None, layers=None):
        return copy_of(c, spec, meta, layers).to_payload()

    return {
        "unknown compressor name": payload(kivi4, meta={"compressor": "zip9"}),
        "wrong layer count": payload(kivi4, layers=kivi4.layers[:1]),
        "bits do not match the tensors": payload(kivi2, spec=KIVI4.spec, meta={"bits": 4}),
        "meta bits do not match the spec": payload(kivi4, meta={"bits": 2}),
        "token-dropping spec on quantized tensors": payload(kivi4, spec=snap.spec, meta=snap.meta),
        "token-dropping meta on quantized tensors": payload(kivi4, meta=snap.meta),
        "quantized spec on token-dropped tensors": payload(snap, spec=KIVI4.spec, meta=kivi4.meta),
        "group 0": payload(kivi4, meta={"group": 0}),
    }


# ---- Compressor.validate ---------------------------------------------------------------------------
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_compressors_own_copy_is_valid(preset):
    c = get_compressor(preset)
    for t in (1, 37, T):
        validate(copy_of(c.compress(random_prefix(t))), c, t)


@pytest.mark.parametrize("name", sorted(bad_variants()))
def test_inconsistent_copies_are_refused(name):
    meta, layers = bad_variants()[name]
    with pytest.raises(ValueError, match="compressed copy"):
        validate(LayeredKV.from_payload(meta, layers))


def test_copy_of_another_model_or_prompt_length_is_refused():
    comp = copy_of(KIVI4.compress(random_prefix()))
    with pytest.raises(ValueError, match="2 layers, the model 3"):
        KIVI4.validate(comp, T, 3, H_KV, D)
    with pytest.raises(ValueError, match="meta"):
        KIVI4.validate(comp, T - 16, LAYERS, H_KV, D)
    with pytest.raises(ValueError, match="expected"):
        KIVI4.validate(comp, T, LAYERS, H_KV + 1, D)


def test_values_are_checked_not_only_shapes():
    comp = copy_of(KIVI4.compress(random_prefix()))
    comp.layers[1]["k_scale"][0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        validate(comp)
    drop = get_compressor("knorm-4x")
    for fix, why in ((lambda i: i.fill_(T), "outside"), (lambda i: i.flip(-1), "not increasing")):
        comp = copy_of(drop.compress(random_prefix()))
        comp.layers[0]["idx"] = fix(comp.layers[0]["idx"].clone())
        with pytest.raises(ValueError, match=why):
            validate(comp, drop)


def test_payload_without_a_spec_is_a_value_error():
    meta, layers = KIVI4.compress(random_prefix()).to_payload()
    del meta["spec"]
    with pytest.raises(ValueError, match="names no spec"):
        LayeredKV.from_payload(meta, layers)


# ---- RemotePrefixCache: a bad compressed copy is a miss of that copy ---------------------------------
@pytest.fixture(scope="module")
def tiny():
    engine = tiny_engine()
    ids = [int(x) for x in torch.randint(3, 256, (T + 9,), generator=torch.Generator().manual_seed(1))]
    cfg = DecodeConfig(max_new_tokens=12, draft_k=4, stop_at_eos=False)
    pre = engine.prefill(ids[:T])
    return engine, ids, cfg, pre, engine.generate_full([engine.prefill(ids)], cfg)[0]


def loop_tasks(cache: RemotePrefixCache) -> int:
    async def count():
        return len(asyncio.all_tasks()) - 1

    return cache.client.call(count())


@pytest.mark.parametrize("name", sorted(bad_variants()))
def test_bad_compressed_copy_falls_back_to_the_full_copy(tiny, name, caplog):
    engine, ids, cfg, pre, ref = tiny
    url = f"local://bad{uuid.uuid4().hex[:8]}"
    layers = [{"k": k, "v": v} for k, v in zip(pre.prefix.keys, pre.prefix.values)]

    async def seed():
        async with DualCopyStore(url, engine.model_name, engine.model.dtype, 64) as st:
            await st.put_prefix(ids[:T], layers, {KIVI4.spec: bad_variants()[name]})

    run(seed())
    try:
        caplog.set_level(logging.WARNING, "vericache.remote")
        with RemotePrefixCache(engine, RemoteCacheConfig(url=url, chunk_size=64)) as cache:
            res = cache.generate(ids, cfg)
            assert (res.path, res.tokens, res.wrote) == ("full-only", ref, True)
            assert "compressed copy unusable" in caplog.text and res.error
            assert loop_tasks(cache) == 0  # the stream ended; nothing runs on the store loop
            again = cache.generate(ids, cfg)  # the copy written back is good
            assert (again.path, again.tokens) == ("hit", ref)
    finally:
        drop_memory_store(url.removeprefix("local://"))


def test_a_failure_while_streaming_cancels_the_stream(tiny, memory_url, monkeypatch):
    """An error after the full copy started streaming (here: in the decoding loop) propagates, and the
    stream is stopped before generate returns: nothing keeps writing into the request's cache."""
    engine, ids, cfg, _, _ = tiny
    with RemotePrefixCache(engine, RemoteCacheConfig(url=memory_url, chunk_size=64)) as cache:
        cache.generate(ids, cfg)  # miss: stores both copies
    slow = RemoteCacheConfig(url=memory_url, chunk_size=64, bandwidth_bytes_per_s=20_000)  # ~ 13 s of full copy
    with RemotePrefixCache(engine, slow) as cache:

        def boom(*a, **k):
            raise RuntimeError("boom")

        monkeypatch.setattr(cache, "decode", boom)
        with pytest.raises(RuntimeError, match="boom"):
            cache.generate(ids, cfg)
        assert loop_tasks(cache) == 0
