"""Stores shared with others: a keyed MAC over every manifest and payload (off by default; tested both
ways), and payload reads bounded by the manifest's size (S3: a planted huge object is never read)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from urllib.parse import urlsplit

import pytest
import torch

from storage_backends import CorruptObject, DualCopyStore, MissingObject, open_backend
from storage_backends.keys import FULL
from storage_backends.manifest import Manifest

from net import TcpProxy
from stores import random_kv, random_tokens, run

MODEL = "SmolLM2-135M.0123456789abcdef"
KEY = b"test-mac-key-0123456789abcdef"
SPEC = "snapkv:ratio=4"


@pytest.fixture(params=["memory", "redis"])
def url(request):
    return request.getfixturevalue(f"{request.param}_url")


def copies(seed: int):
    tokens = random_tokens(300)
    kv = random_kv(2, 2, 300, 8, torch.float16, seed=seed)
    g = torch.Generator().manual_seed(seed)
    comp = {SPEC: ({"keep": seed}, [{"k": torch.randn(2, 75, 8, generator=g).half()} for _ in range(2)])}
    return tokens, kv, comp


async def read_all(store: DualCopyStore, tokens):
    """(lookup, has_compressed, get_compressed or the error, get_full or the error)."""
    out = [await store.lookup(tokens), await store.has_compressed(tokens, SPEC)]
    for call in (store.get_compressed(tokens, SPEC), store.get_full(tokens)):
        try:
            out.append(await call)
        except (CorruptObject, MissingObject) as e:
            out.append(e)
    return out


def same_full(got, kv) -> bool:
    return len(got) == len(kv) and all(torch.equal(k, x["k"]) and torch.equal(v, x["v"]) for (k, v), x in zip(got, kv))


def same_compressed(got, comp) -> bool:
    meta, layers = comp[SPEC]
    return got[0] == meta and all(torch.equal(a["k"], b["k"]) for a, b in zip(got[1], layers))


def test_with_a_key_entries_round_trip(url):
    tokens, kv, comp = copies(0)

    async def go():
        async with DualCopyStore(url, MODEL, torch.float16, mac_key=KEY) as w:
            await w.put_prefix(tokens, kv, comp)
        async with DualCopyStore(url, MODEL, torch.float16, mac_key=KEY) as r:
            return await read_all(r, tokens)

    found, has, got_comp, got_full = run(go())
    assert (found, has) == (300, True)
    assert same_compressed(got_comp, comp) and same_full(got_full, kv)


def test_without_a_key_a_planted_entry_is_served(url):
    """The default (no key): checksums catch corruption, not tampering. A writer of the shared store
    plants KV for a prefix, and a reader serves it. This is what mac_key is for."""
    tokens, kv, comp = copies(0)
    _, fake_kv, fake_comp = copies(7)

    async def go():
        async with DualCopyStore(url, MODEL, torch.float16) as attacker:
            await attacker.put_prefix(tokens, fake_kv, fake_comp)
        async with DualCopyStore(url, MODEL, torch.float16) as r:
            return await read_all(r, tokens)

    found, has, got_comp, got_full = run(go())
    assert (found, has) == (300, True)
    assert same_full(got_full, fake_kv) and same_compressed(got_comp, fake_comp)


@pytest.mark.parametrize("attacker_key", [None, b"another-key-0123456789abcdef"], ids=["no-key", "wrong-key"])
def test_with_a_key_a_planted_entry_is_a_miss_with_a_warning(url, attacker_key, caplog):
    tokens, _, _ = copies(0)
    _, fake_kv, fake_comp = copies(7)

    async def go():
        async with DualCopyStore(url, MODEL, torch.float16, mac_key=attacker_key) as attacker:
            await attacker.put_prefix(tokens, fake_kv, fake_comp)
        async with DualCopyStore(url, MODEL, torch.float16, mac_key=KEY) as r:
            return await read_all(r, tokens)

    from storage_backends import UnauthenticatedObject

    with caplog.at_level(logging.WARNING, logger="vericache.store"):
        found, has, got_comp, got_full = run(go())
    assert (found, has, got_comp) == (0, False, None)
    assert isinstance(got_full, UnauthenticatedObject)
    assert any("MAC" in r.getMessage() for r in caplog.records)


def test_with_a_key_tampering_with_a_keyed_entry_is_a_miss(url):
    """Changes a writer without the key can make to keyed entries: a payload byte, a manifest field
    with its self-checksum redone, another authentic payload or manifest moved under this key."""
    tokens, kv, comp = copies(0)
    other_tokens = random_tokens(300, seed=5)
    _, other_kv, other_comp = copies(5)

    async def go():
        results = []
        async with DualCopyStore(url, MODEL, torch.float16, mac_key=KEY) as s:
            await s.put_prefix(tokens, kv, comp)
            await s.put_prefix(other_tokens, other_kv, other_comp)
            raw = s.raw_backend
            chunks, other = s.keys.chunks(tokens), s.keys.chunks(other_tokens)
            full0 = Manifest.from_bytes(await raw.get(chunks[0].copy(FULL)), None, s._mac)
            comp_m = Manifest.from_bytes(await raw.get(chunks[-1].copy(SPEC)), None, s._mac)
            other_comp_m = Manifest.from_bytes(await raw.get(other[-1].copy(SPEC)), None, s._mac)

            def recheck(m_bytes: bytes, **fields) -> bytes:
                body = json.loads(m_bytes[20:])
                body.update(fields)
                b = json.dumps(body).encode()
                return b"VCMF" + hashlib.blake2b(b, digest_size=16).digest() + b

            payload = bytearray(await raw.get(full0.payload_key))
            payload[full0.layers[1].offset + 3] ^= 1
            tamper = [
                (full0.payload_key, bytes(payload)),
                (chunks[0].copy(FULL), recheck(await raw.get(chunks[0].copy(FULL)), end_token=255)),
                (chunks[0].copy(FULL), await raw.get(other[0].copy(FULL))),  # authentic, other key
                (comp_m.payload_key, await raw.get(other_comp_m.payload_key)),  # authentic, other payload
                (chunks[-1].copy(SPEC), recheck(await raw.get(chunks[-1].copy(SPEC)), meta={"x": 1})),
            ]
            for key, data in tamper:
                original = await raw.get(key)
                await raw.put(key, data)
                results.append(await read_all(s, tokens))
                await raw.put(key, original)
            results.append(await read_all(s, tokens))  # restored: whole again
        return results

    from storage_backends import UnauthenticatedObject

    r = run(go())
    for _, _, got_comp, got_full in r:  # whatever is served is the original
        assert isinstance(got_full, CorruptObject) or same_full(got_full, kv)
        assert got_comp is None or isinstance(got_comp, CorruptObject) or same_compressed(got_comp, comp)
    assert isinstance(r[0][3], CorruptObject)  # a payload byte: its layer's keyed checksum
    assert r[1][0] == 0 and isinstance(r[1][3], UnauthenticatedObject)  # a field: the manifest's MAC
    assert r[2][0] == 0 and isinstance(r[2][3], CorruptObject)  # another chunk's manifest: its key
    assert isinstance(r[3][2], CorruptObject)  # another prefix's payload: the manifest's checksum
    assert r[4][1] is False and r[4][2] is None  # the compressed manifest: its MAC, a miss
    found, has, got_comp, got_full = r[-1]
    assert (found, has) == (300, True) and same_full(got_full, kv) and same_compressed(got_comp, comp)


def test_keyed_entries_are_misses_for_a_reader_without_the_key(url):
    tokens, kv, comp = copies(0)

    async def go():
        async with DualCopyStore(url, MODEL, torch.float16, mac_key=KEY) as w:
            await w.put_prefix(tokens, kv, comp)
        async with DualCopyStore(url, MODEL, torch.float16) as r:
            return await read_all(r, tokens)

    from storage_backends import UnauthenticatedObject

    _, _, got_comp, got_full = run(go())
    assert got_comp is None and isinstance(got_full, UnauthenticatedObject)


def test_mac_key_from_a_mounted_file(tmp_path, memory_url):
    from storage_backends import secret_from_env

    (tmp_path / "mac-key").write_bytes(KEY + b"\n")
    key = secret_from_env("VERICACHE_MAC_KEY", {"VERICACHE_MAC_KEY_FILE": str(tmp_path / "mac-key")})
    assert key == KEY
    tokens, kv, comp = copies(0)

    async def go():
        async with DualCopyStore(memory_url, MODEL, torch.float16, mac_key=key) as s:
            await s.put_prefix(tokens, kv, comp)
            return await read_all(s, tokens)

    assert run(go())[:2] == [300, True]
    with pytest.raises(ValueError, match="16 bytes"):
        DualCopyStore(memory_url, MODEL, torch.float16, mac_key=b"short")
    with pytest.raises(ValueError, match="algo"):
        DualCopyStore(memory_url, MODEL, torch.float16, mac_key=KEY, algo="crc32")


# -- reads bounded by the manifest ----------------------------------------------------------------------


def test_s3_compressed_read_is_bounded_by_the_manifest(s3_url):
    """A compressed payload replaced by a 4 MB object: the reader fetches no more than the manifest's
    size + 1 bytes of it (a range read) before it finds the copy resized."""
    endpoint = urlsplit(s3_url.split("endpoint_url=")[1].split("&")[0])
    proxy = TcpProxy(endpoint.hostname, endpoint.port)
    proxied = s3_url.replace(f":{endpoint.port}", f":{proxy.port}")
    tokens, _, comp = copies(0)

    async def go():
        async with DualCopyStore(proxied, MODEL, torch.float16) as s:
            await s.put_prefix(tokens, compressed=comp)
            m = Manifest.from_bytes(await s.raw_backend.get(s.keys.prefix_key(tokens).copy(SPEC)))
            await s.raw_backend.put(m.payload_key, os.urandom(4 << 20))
            await s.get_compressed(tokens, "kivi:bits=2")  # warm the connection: a miss
            before = proxy.bytes_relayed
            with pytest.raises(CorruptObject, match="resized"):
                await s.get_compressed(tokens, SPEC)
            return proxy.bytes_relayed - before, m.size

    try:
        relayed, size = run(go())
    finally:
        proxy.close()
    assert relayed < size + 64 * 1024, f"{relayed} bytes crossed the link for a {size}-byte payload"


def test_s3_whole_object_get_checks_the_size_before_reading(s3_url, monkeypatch):
    from botocore.response import StreamingBody

    reads = []
    real_read = StreamingBody.read

    def spy(self, amt=None):
        data = real_read(self, amt)
        reads.append(len(data))
        return data

    async def go():
        b = open_backend(s3_url, max_object_bytes=1000)
        await b.put("big", os.urandom(5000))
        await b.put("small", b"x" * 1000)
        monkeypatch.setattr(StreamingBody, "read", spy)
        with pytest.raises(CorruptObject, match="5000 bytes"):
            await b.get("big")
        assert reads == []  # refused from the response's Content-Length: no body byte was read
        assert await b.get("small") == b"x" * 1000
        assert len(await b.get_range("big", 0, 500)) == 500  # ranges are bounded by themselves
        await b.close()

    run(go())
