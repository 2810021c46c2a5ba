"""LMCache's keys in ours (storage_backends/lmcache_keys.py), the chain tap, and the L2 adapter's settings."""

from __future__ import annotations

import logging

import pytest
import torch

from storage_backends import KeySpace
from storage_backends.lmcache_keys import ModelNaming, check_salt, kv_rank_layout, lmcache_chain_hashes, salt_tag
from vericache_connector.integration.lmcache.chain_tap import ChainTap

from stores import has_module, need, random_tokens


def test_chain_hashes_are_lmcache_mp_servers_own():
    need(has_module("lmcache"), "lmcache is not installed")
    from lmcache.v1.multiprocess.token_hasher import TokenHasher

    tokens = random_tokens(1000, seed=3)
    theirs = TokenHasher(chunk_size=256, hash_algorithm="blake3").compute_chunk_hashes(tokens)
    ours = lmcache_chain_hashes(tokens, 256)
    assert len(theirs) == 3 and len(ours) == 4  # LMCache drops the partial last chunk, we keep it
    assert [h.to_bytes(32, "big") for h in ours[:3]] == theirs
    assert lmcache_chain_hashes(tokens[:512], 256) == ours[:2]  # a prefix's hashes are the prefix of the hashes
    assert lmcache_chain_hashes([7] + tokens[1:512], 256)[1] != ours[1]  # every chunk depends on all before it
    with pytest.raises(ValueError, match="uint32"):
        lmcache_chain_hashes([1 << 32], 256)


def test_keyspace_lmcache_hashing_and_salt():
    tokens = random_tokens(600, seed=1)
    plain = KeySpace("m.0", torch.float32)
    lm = KeySpace("m.0", torch.float32, hashing="lmcache")
    a = KeySpace("m.0", torch.float32, hashing="lmcache", cache_salt="tenant-a")
    b = KeySpace("m.0", torch.float32, hashing="lmcache", cache_salt="tenant-b")
    h = lmcache_chain_hashes(tokens, 256)
    assert [c.chunk_hash for c in lm.chunks(tokens)] == h
    assert lm.chunks(tokens)[0].base == f"m.0@1@0@{h[0]:x}@float"  # LMCache's key layout, its hash
    assert plain.chunks(tokens)[0].base != lm.chunks(tokens)[0].base
    assert a.chunks(tokens)[0].base == lm.chunks(tokens)[0].base + salt_tag("tenant-a")
    keys = {ks.prefix_key(tokens).copy("full") for ks in (plain, lm, a, b)}
    assert len(keys) == 4  # no two hashings or salts share a key
    assert salt_tag("a%b") == "@salt%" + b"a%b".hex() and salt_tag("") == ""
    for bad in ("a@b", "a/b", "x" * 129, 5):
        with pytest.raises(ValueError, match="cache_salt"):
            check_salt(bad)
    with pytest.raises(ValueError, match="hashing"):
        KeySpace("m.0", torch.float32, hashing="sha256")


def test_model_naming_and_kv_rank():
    assert ModelNaming().key_model("org/m") == "org/m"
    assert ModelNaming("m.0123").key_model("org/m") == "m.0123"
    served = ModelNaming("m.0123", served_model="org/m")
    assert served.key_model("org/m") == "m.0123" and served.key_model("org/other") == "org/other"
    assert kv_rank_layout((4 << 24) | (3 << 16) | (4 << 8) | 3) == (4, 3)
    need(has_module("lmcache"), "lmcache is not installed")
    from lmcache.v1.distributed.api import ObjectKey

    assert kv_rank_layout(ObjectKey.ComputeKVRank(2, 1, 2, 1)) == (2, 1)


def test_chain_tap_links_and_bounds(caplog):
    tokens = random_tokens(1024, seed=2)
    hashes = [h.to_bytes(32, "big") for h in lmcache_chain_hashes(tokens, 256)]
    tap = ChainTap(max_chunks=3)
    assert tap.record(tokens, 256, 768, hashes[1:3], 1)  # a STORE of chunks 1..2: records 0..2
    assert tap.prefix_tokens(hashes[2]) == tokens[:768] and tap.prefix_tokens(hashes[0]) == tokens[:256]
    assert tap.prefix_tokens(hashes[3]) is None
    assert tap.record(tokens, 256, 1024, hashes[3:], 3)  # 4 chunks, room for 3: chunk 0 is forgotten
    assert len(tap) == 3 and tap.prefix_tokens(hashes[3]) is None  # a broken chain is unknown, not guessed
    other = ChainTap()
    with caplog.at_level(logging.WARNING, logger="vericache.store"):
        assert not other.record(tokens, 256, 512, [b"\x00" * 8, b"\x01" * 8], 0)  # another --hash-algorithm
    assert len(other) == 0 and "blake3" in caplog.text


def test_l2_settings_validate_and_hide_the_password(monkeypatch):
    need(has_module("lmcache"), "lmcache is not installed")
    from vericache_connector.integration.lmcache.l2_config import L2Settings, VeriCacheL2AdapterConfig

    monkeypatch.delenv("VERICACHE_STORE_URL", raising=False)
    url = "redis://:TOPSECRET@127.0.0.1:6379/0"
    s = VeriCacheL2AdapterConfig.from_dict({"url": url, "kv_dtype": "bfloat16", "head_dim": 128}).settings
    assert s.compressor == "kivi4" and s.chunk_size == 256 and "TOPSECRET" not in repr(s)
    for params, match in [
        ({"url": url, "kv_dtype": "float32", "head_dim": 64, "nope": 1}, "unknown adapter_params"),
        ({"kv_dtype": "float32", "head_dim": 64}, "'url'"),
        ({"url": url, "head_dim": 64}, "'kv_dtype'"),
        ({"url": url, "kv_dtype": "float33", "head_dim": 64}, "float33"),
        ({"url": url, "kv_dtype": "float32"}, "head_dim"),
        ({"url": url, "kv_dtype": "float32", "head_dim": "64"}, "head_dim"),
        ({"url": url, "kv_dtype": "float32", "head_dim": 64, "timeout_s": 0}, "timeout_s"),
    ]:
        with pytest.raises(ValueError, match=match) as e:
            L2Settings.from_params(params)
        assert "TOPSECRET" not in str(e.value)
    monkeypatch.setenv("VERICACHE_STORE_URL", url)  # the URL from a Secret, off argv
    assert L2Settings.from_params({"kv_dtype": "float", "head_dim": 64}).url == url
    assert L2Settings.from_params({"kv_dtype": "float", "head_dim": 64}).dtype == torch.float32
