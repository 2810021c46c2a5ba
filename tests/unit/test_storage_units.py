"""Keys, serialization, manifests, throttle, URL parsing: no server needed."""

import asyncio
import os
import subprocess
import sys
import time

import pytest
import torch

from storage_backends import (
    CorruptObject,
    KeySpace,
    Manifest,
    chain_hashes,
    deserialize,
    open_backend,
    read_header,
    serialize,
)
from storage_backends.keys import check_spec
from storage_backends.manifest import LayerEntry, checksum
from storage_backends.serialization import decode_layer
from storage_backends.throttle import TokenBucket

from stores import ROOT, run  # noqa: F401

ALL_DTYPES = [
    torch.uint8,
    torch.int8,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def rand(dtype, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 3).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g, dtype=dtype)


def same(a, b):
    if a.dtype.is_floating_point and a.dtype.itemsize == 1:  # fp8: compare bits
        a, b = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    return torch.equal(a, b)


# ---------------------------------------------------------------- keys
def test_chain_hash_is_prefix_chained_and_process_stable():
    toks = list(range(1000))
    h = chain_hashes(toks, 256)
    assert len(h) == 4
    assert chain_hashes(toks[:512], 256) == h[:2]  # shared prefix -> shared chunk hashes
    changed = toks.copy()
    changed[10] += 1  # a change in chunk 0 changes every later chunk hash
    h2 = chain_hashes(changed, 256)
    assert all(a != b for a, b in zip(h, h2))
    changed = toks.copy()
    changed[600] += 1
    h3 = chain_hashes(changed, 256)
    assert h3[:2] == h[:2] and h3[2:] != h[2:]
    code = (
        "import sys; sys.path.insert(0, %r); from storage_backends.keys import chain_hashes; "
        "print(chain_hashes(list(range(1000)), 256))" % ROOT
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert outs == {str(h)}


def test_key_strings_follow_lmcache_layout_and_separate_models_and_dtypes():
    ks = KeySpace("HuggingFaceTB/SmolLM2-135M", torch.bfloat16)
    c = ks.chunks(list(range(300)))
    assert [(x.start, x.end) for x in c] == [(0, 256), (256, 300)]
    parts = c[0].base.split("@")
    assert parts == ["HuggingFaceTB/SmolLM2-135M", "1", "0", f"{c[0].chunk_hash:x}", "bfloat16"]
    assert c[1].copy("full").endswith("@copy%full")
    assert c[1].copy("kivi:bits=4,group=32") != c[1].copy("kivi:bits=2,group=32")
    other_dtype = KeySpace("HuggingFaceTB/SmolLM2-135M", torch.float16).chunks(list(range(300)))
    other_model = KeySpace("other-model", torch.bfloat16).chunks(list(range(300)))
    assert c[1].copy("full") not in {other_dtype[1].copy("full"), other_model[1].copy("full")}
    assert KeySpace("m", "float16").dtype_name == "half" == KeySpace("m", torch.half).dtype_name


@pytest.mark.parametrize("bad", ["", "a@b", "a%b", "a/b", "a b", None])
def test_bad_specs_raise_value_error(bad):
    with pytest.raises(ValueError):
        check_spec(bad)


@pytest.mark.parametrize("bad", ["", "a@b", "a%b"])
def test_bad_model_names_raise_value_error(bad):
    with pytest.raises(ValueError, match="model_name"):
        KeySpace(bad, torch.float16)


def test_keys_parse_with_lmcache_cache_engine_key():
    pytest.importorskip("lmcache.utils", reason="lmcache not installed")  # also tested in test_storage_lmcache
    from lmcache.utils import CacheEngineKey

    ks = KeySpace("smol", torch.float16)
    c = ks.prefix_key(list(range(10)))
    parsed = CacheEngineKey.from_string(c.base)
    assert (parsed.model_name, parsed.chunk_hash, parsed.dtype) == ("smol", c.chunk_hash, torch.float16)
    assert parsed.to_string() == c.base
    tagged = CacheEngineKey.from_string(c.copy("kivi:bits=4"))
    assert tagged.tags == (("copy", "kivi:bits=4"),)


# ---------------------------------------------------------------- serialization
def test_layered_payload_round_trips_every_dtype_and_single_layers():
    layers = [{str(d).removeprefix("torch."): rand(d, (3, 7, 5), i)} for i, d in enumerate(ALL_DTYPES)]
    layers.append({"k": rand(torch.float32, (2, 9, 4)).transpose(1, 2), "empty": torch.zeros(0, 4)})
    meta = {"spec": "kivi:bits=4", "nested": {"a": [1, 2]}}
    data, spans = serialize(meta, layers)
    meta2, layers2 = deserialize(data)
    assert meta2 == meta and len(layers2) == len(layers)
    for a, b in zip(layers, layers2):
        assert a.keys() == b.keys()
        for name in a:
            assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape
            assert same(a[name], b[name]), name
    h_meta, h_spans = read_header(data)
    assert h_spans == spans and h_meta == meta
    one = decode_layer(data[spans[4].offset : spans[4].end])  # any layer alone, from a range
    assert torch.equal(one["float32"], layers[4]["float32"])


def test_payload_damage_is_detected():
    data, spans = serialize({}, [{"x": torch.arange(10.0)}])
    with pytest.raises(CorruptObject):
        deserialize(b"XXXX" + data[4:])
    with pytest.raises(CorruptObject):
        deserialize(data[: spans[0].offset + 5])
    with pytest.raises(ValueError):
        serialize({"bad": object()}, [])


# ---------------------------------------------------------------- manifest
def make_manifest(**kw):
    args = dict(
        key="m@1@0@ab@half@copy%full",
        copy="full",
        model="m",
        dtype="half",
        payload_key="m@1@0@ab@half@copy%full@blob%00",
        size=4,
        checksum=checksum(b"abcd"),
        layers=[LayerEntry(0, 2, checksum(b"ab")), LayerEntry(2, 2, checksum(b"cd"))],
        start_token=0,
        end_token=256,
    )
    args.update(kw)
    return Manifest(**args)


def test_manifest_round_trip_and_checks():
    m = make_manifest()
    raw = m.to_bytes()
    m2 = Manifest.from_bytes(raw, m.key)
    assert m2 == m and m2.num_tokens == 256
    assert m2.verify_payload(b"abcd") == b"abcd"
    assert m2.verify_layer(1, b"cd") == b"cd"
    with pytest.raises(CorruptObject, match="checksum"):
        m2.verify_payload(b"abce")
    with pytest.raises(CorruptObject, match="truncated"):
        m2.verify_payload(b"abc")
    with pytest.raises(CorruptObject, match="layer 0"):
        m2.verify_layer(0, b"ax")
    bad = bytearray(raw)
    bad[-3] ^= 1
    with pytest.raises(CorruptObject):
        Manifest.from_bytes(bytes(bad))
    with pytest.raises(CorruptObject):
        Manifest.from_bytes(raw[:-1])
    with pytest.raises(CorruptObject, match="another key"):
        Manifest.from_bytes(raw, "some-other-key")
    crc = make_manifest(algo="crc32", checksum=checksum(b"abcd", "crc32"))
    assert Manifest.from_bytes(crc.to_bytes()).verify_payload(b"abcd")


# ---------------------------------------------------------------- throttle / URLs
def test_token_bucket_enforces_rate():
    async def go():
        bucket = TokenBucket(2_000_000, burst=100_000)
        t = time.monotonic()
        for _ in range(10):
            await bucket.acquire(100_000)
        return time.monotonic() - t

    elapsed = run(go())
    assert 0.40 <= elapsed < 2.0  # 1 MB at 2 MB/s minus the 0.1 MB burst = 0.45 s


@pytest.mark.parametrize(
    "url",
    ["redis//x", "ftp://host/x", "nixl://", "nixl://host", "redis://:notaport/0", "s3://", "local://x?bogus=1", 42],
)
def test_bad_urls_raise_value_error_naming_the_url(url):
    with pytest.raises(ValueError) as e:
        open_backend(url)
    assert repr(url) in str(e.value) or str(url) in str(e.value)


def test_open_backend_imports_no_client_at_import_time():
    code = (
        "import sys; sys.path.insert(0, %r); import storage_backends; "
        "print(sorted(m for m in ('redis', 'boto3', 'nixl', 'lmcache') if m in sys.modules))" % ROOT
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_event_loop_is_not_required_for_construction():
    b = open_backend("redis://127.0.0.1:1/0")  # nothing connects until used
    assert asyncio.run(b.close()) is None


def test_redact_url_hides_passwords_only():
    from storage_backends import redact_url

    assert redact_url("redis://:s3cret@redis:6379/0") == "redis://:***@redis:6379/0"
    assert redact_url("rediss://app:s3cret@h:1/2?prefix=a") == "rediss://***@h:1/2?prefix=a"  # user name too
    for url in ("redis://h:6379/0", "local:///tmp/kv", "s3://b/p?endpoint_url=http://127.0.0.1:9000"):
        assert redact_url(url) == url


# ---------------------------------------------------------------- crafted manifests, MAC
def craft(m: Manifest, **fields) -> bytes:
    """m's bytes with fields replaced and a VALID self-checksum: what a writer without a MAC key can do."""
    import hashlib
    import json

    body = json.loads(m.to_bytes()[20:])
    body.update(fields)
    raw = json.dumps(body).encode()
    return b"VCMF" + hashlib.blake2b(raw, digest_size=16).digest() + raw


@pytest.mark.parametrize(
    "fields",
    [
        {"layers": [{"offset": -4, "length": 2, "checksum": "x"}]},
        {"layers": [{"offset": 0, "length": 99, "checksum": "x"}]},  # past the payload's size
        {"layers": []},
        {"layers": "ab"},
        {"size": True},
        {"size": "4"},
        {"start_token": 256, "end_token": 0},
        {"end_token": 2.5},
        {"meta": [1, 2]},
        {"checksum": 7},
        {"algo": "md5"},
        {"model": None},
        {"unknown_field": 1},
        {"kind": "other"},
    ],
)
def test_crafted_manifest_fields_are_corrupt_objects(fields):
    with pytest.raises(CorruptObject):
        Manifest.from_bytes(craft(make_manifest(), **fields))


def test_manifest_mac_both_ways():
    from storage_backends import Mac, UnauthenticatedObject

    mac = Mac(b"k" * 32)
    keyed = make_manifest(algo="blake2b-mac", checksum=checksum(b"abcd", "blake2b-mac", mac))
    keyed.layers = [
        LayerEntry(0, 2, checksum(b"ab", "blake2b-mac", mac)),
        LayerEntry(2, 2, checksum(b"cd", "blake2b-mac", mac)),
    ]
    raw = keyed.to_bytes(mac)
    m = Manifest.from_bytes(raw, keyed.key, mac)
    assert m.verify_payload(b"abcd", mac) == b"abcd" and m.verify_layer(1, b"cd", mac) == b"cd"
    with pytest.raises(CorruptObject, match="checksum"):
        m.verify_payload(b"abce", mac)
    with pytest.raises(UnauthenticatedObject):  # another key
        Manifest.from_bytes(raw, keyed.key, Mac(b"j" * 32))
    with pytest.raises(UnauthenticatedObject):  # a reader without the key
        Manifest.from_bytes(raw, keyed.key)
    with pytest.raises(UnauthenticatedObject):  # a field changed and the self-checksum redone
        Manifest.from_bytes(craft(m, end_token=512), keyed.key, mac)
    with pytest.raises(UnauthenticatedObject):  # an entry written without a key, read with one
        Manifest.from_bytes(make_manifest().to_bytes(), None, mac)
    with pytest.raises(UnauthenticatedObject):  # plain checksums recomputed over keyed ones
        Manifest.from_bytes(craft(m, algo="blake2b", mac=""), keyed.key, mac)
    with pytest.raises(CorruptObject):
        m.verify_layer(5, b"cd", mac)


def test_crafted_payload_headers_are_corrupt_objects():
    import json
    import struct

    data, _ = serialize({"a": 1}, [{"x": torch.arange(4.0)}])
    hlen = struct.unpack_from("<I", data, 4)[0]
    header = json.loads(data[8 : 8 + hlen])
    for change in ({"meta": [1]}, {"layers": [[-5, 10]]}, {"layers": [["0", 1]]}, {"v": 9}, {"layers": [[0, 10**9]]}):
        body = json.dumps({**header, **change}).encode()
        crafted = data[:4] + struct.pack("<I", len(body)) + body + data[8 + hlen :]
        with pytest.raises(CorruptObject):
            deserialize(crafted)
    with pytest.raises(CorruptObject):
        read_header(data[:4] + struct.pack("<I", 1 << 30) + data[8:])


def test_model_identity_separates_checkpoints_and_not_dtype_spellings(tmp_path):
    import json

    from storage_backends.identity import dir_model_id, model_fingerprint

    dirs = []
    for run_name, hidden in (("runA", 1), ("runB", 2)):
        d = tmp_path / run_name / "checkpoint"
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps({"hidden": hidden}))
        dirs.append(d)
    a, b = (dir_model_id(d, torch.float32) for d in dirs)
    assert a != b and a.split(".")[0] == b.split(".")[0] == "checkpoint"
    assert {model_fingerprint(dirs[0], s) for s in (torch.float32, "float32", "float", "torch.float32")} == {
        a.split(".")[1]
    }
    assert model_fingerprint(dirs[0], "float16") != a.split(".")[1]
    assert dir_model_id(dirs[0], "float", name="smol/v1") == f"smol-v1.{a.split('.')[1]}"
    with pytest.raises(ValueError, match="dtype"):
        model_fingerprint(dirs[0], "float33")
