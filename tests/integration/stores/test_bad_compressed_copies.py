"""The real model: a compressed copy that passed its checksums but does not fit the model or its own
metadata (the variants of issue 13: unknown compressor name, wrong layer count, bits that do not match
the tensors, a token-dropping spec on quantized tensors, group 0) is a miss of that copy. generate does
not raise: it decodes from the full copy, gives the full-KV greedy output token for token, leaves no
stream running and writes a good compressed copy back (the next request is a hit)."""

from __future__ import annotations

import asyncio
import logging
import uuid

import pytest

from storage_backends import DualCopyStore, stored_prefix_len
from vericache_connector.compressors import LayeredKV, get_compressor
from vericache_connector.data import load_prompt
from vericache_connector.engine import DecodeConfig
from vericache_connector.remote import RemoteCacheConfig, RemotePrefixCache

from stores import drop_memory_store, run

pytestmark = pytest.mark.slow

CFG = DecodeConfig(max_new_tokens=24, draft_k=8, stop_at_eos=False)
KIVI4 = get_compressor("kivi4")


@pytest.fixture(scope="module")
def case(engine):
    ids = engine.encode(load_prompt("graphlib_py"))
    stored = stored_prefix_len(len(ids), 256)
    pre = engine.prefill(ids[:stored])
    return ids, stored, pre, engine.generate_full([engine.prefill(ids)], CFG)[0]


def variant(name: str, pre) -> tuple[dict, list]:
    """(meta, layers) stored under kivi4's spec, inconsistent in one way."""
    kivi4, kivi2 = KIVI4.compress(pre.prefix), get_compressor("kivi2").compress(pre.prefix)
    snap = get_compressor("snapkv-4x").compress(pre.prefix)
    meta, layers = kivi4.to_payload()
    if name == "unknown compressor name":
        meta = {**meta, "compressor": "zip9"}
    elif name == "wrong layer count":
        layers = layers[:-2]
    elif name == "bits that do not match the tensors":
        meta, layers = {**kivi2.to_payload()[0], "spec": KIVI4.spec, "bits": 4}, kivi2.layers
    elif name == "token-dropping spec on quantized tensors":
        meta = {**snap.meta, "spec": snap.spec}
    elif name == "group 0":
        meta = {**meta, "group": 0}
    return meta, layers


@pytest.mark.parametrize(
    "name",
    [
        "unknown compressor name",
        "wrong layer count",
        "bits that do not match the tensors",
        "token-dropping spec on quantized tensors",
        "group 0",
    ],
)
def test_inconsistent_compressed_copy_is_a_miss_of_that_copy(engine, case, name, caplog):
    ids, stored, pre, ref = case
    url = f"local://badcopy{uuid.uuid4().hex[:8]}"
    layers = [{"k": k, "v": v} for k, v in zip(pre.prefix.keys, pre.prefix.values)]

    async def seed():
        async with DualCopyStore(url, engine.model_name, engine.model.dtype, 256) as st:
            await st.put_prefix(ids[:stored], layers, {KIVI4.spec: variant(name, pre)})

    async def tasks_left():
        return len(asyncio.all_tasks()) - 1

    run(seed())
    caplog.set_level(logging.WARNING, "vericache.remote")
    try:
        with RemotePrefixCache(engine, RemoteCacheConfig(url=url)) as cache:
            res = cache.generate(ids, CFG)
            assert (res.path, res.tokens, res.wrote) == ("full-only", ref, True), res.error
            assert "compressed copy unusable" in caplog.text
            assert cache.client.call(tasks_left()) == 0
            again = cache.generate(ids, CFG)
            assert (again.path, again.tokens) == ("hit", ref)
            got = run(_fetch(url, engine, ids[:stored]))
            assert isinstance(got, LayeredKV) and got.meta == KIVI4.compress(pre.prefix).meta
    finally:
        drop_memory_store(url.removeprefix("local://"))


async def _fetch(url, engine, prefix):
    async with DualCopyStore(url, engine.model_name, engine.model.dtype, 256) as st:
        return LayeredKV.from_payload(*await st.get_compressed(prefix, KIVI4.spec))
