"""The store's MAC key reaches it through RemoteCacheConfig.mac_key_file (or $VERICACHE_MAC_KEY): a reader
with the writer's key hits, a reader with another key or none never uses the entries, and every output
is the full-KV output (tiny random-weight model, an in-process store)."""

from __future__ import annotations

import pytest

from vericache_connector.engine import DecodeConfig
from vericache_connector.remote import RemoteCacheConfig, RemotePrefixCache

from stores import drop_memory_store
from tiny_model import tiny_engine

CFG = DecodeConfig(max_new_tokens=8, draft_k=4, stop_at_eos=False)


@pytest.fixture
def setup(tmp_path):
    eng = tiny_engine()
    prompt = [(7 * i) % 256 for i in range(600)]
    ref = eng.generate_full([eng.prefill(prompt)], CFG)[0]
    keys = {}
    for name, key in (("a", b"k" * 32), ("b", b"z" * 32)):
        keys[name] = tmp_path / f"{name}.key"
        keys[name].write_bytes(key)
    yield eng, prompt, ref, keys
    drop_memory_store("mac-test")


def serve(eng, prompt, **kw):
    cfg = RemoteCacheConfig(url="local://mac-test", compressor="int8", model_name="tiny", **kw)
    with RemotePrefixCache(eng, cfg) as cache:
        return cache.generate(prompt, CFG)


def test_only_the_writers_key_reads_its_entries(setup, monkeypatch):
    eng, prompt, ref, keys = setup
    monkeypatch.delenv("VERICACHE_MAC_KEY", raising=False)
    monkeypatch.delenv("VERICACHE_MAC_KEY_FILE", raising=False)
    first = serve(eng, prompt, mac_key_file=str(keys["a"]))
    assert first.path == "miss" and first.wrote and first.tokens == ref
    assert serve(eng, prompt, mac_key_file=str(keys["a"])).path == "hit"
    monkeypatch.setenv("VERICACHE_MAC_KEY_FILE", str(keys["a"]))  # the key from the environment
    assert serve(eng, prompt).path == "hit"
    monkeypatch.delenv("VERICACHE_MAC_KEY_FILE")
    for kw in ({"mac_key_file": str(keys["b"])}, {}):  # (each rewrites what it cannot read: still exact)
        res = serve(eng, prompt, **kw)
        assert res.path != "hit" and res.tokens == ref


def test_mac_key_file_never_shows_the_key(setup):
    _, _, _, keys = setup
    cfg = RemoteCacheConfig(url="local://mac-test", mac_key_file=str(keys["a"]))
    assert "kkkk" not in repr(cfg)
    with pytest.raises(ValueError, match="MAC key"):
        RemotePrefixCache(tiny_engine(), RemoteCacheConfig(url="local://mac-test", mac_key_file="/nonexistent/key"))
