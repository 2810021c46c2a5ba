"""A seeded fuzz of the store readers: random bytes, truncations, bit flips, deletions and header
mutations (JSON fields changed, self-checksums redone) of real stored objects. Nothing may escape a
reader but a StoreError, and whatever a reader returns must be the original data. With a MAC key,
consistent tampering (every unkeyed checksum redone) must be a miss too.

The LMCache plugin's objects get the same treatment in test_storage_lmcache.py (test_lmcache_objects_fuzz).
"""

from __future__ import annotations

import hashlib
import json
import random
import struct

import pytest
import torch

from storage_backends import DualCopyStore, Manifest, StoreError, deserialize, read_header
from storage_backends.manifest import checksum

from stores import random_kv, random_tokens, run

MODEL = "fuzz-model.0123456789abcdef"
SPEC = "kivi:bits=4,group=32"
KEY = b"fuzz-mac-key-0123456789abcdef"
JUNK = [None, -1, 0, 1, 2, -2, 1 << 70, 2.5, "x", "", [], {}, [[0, 1]], {"token_dim": 0}, True, "\u00e9" * 32]


def mutations(rnd: random.Random, data: bytes, is_manifest: bool):
    """One mutation of data: (label, new bytes or None for 'deleted')."""
    kind = rnd.randrange(7)
    if kind == 0:
        out = bytearray(data)
        for _ in range(rnd.randint(1, 4)):
            out[rnd.randrange(len(out))] ^= 1 << rnd.randrange(8)
        return "bit flips", bytes(out)
    if kind == 1:
        return "truncated", data[: rnd.randrange(len(data))]
    if kind == 2:
        return "extended", data + rnd.randbytes(rnd.randint(1, 100))
    if kind == 3:
        out = rnd.randbytes(rnd.randint(0, 400))
        return "random", (data[:4] + out) if rnd.random() < 0.5 else out
    if kind == 4:
        return "deleted", None
    if is_manifest:
        return "manifest field", manifest_mutation(rnd, data)
    return "payload header", payload_mutation(rnd, data)


def manifest_mutation(rnd: random.Random, data: bytes) -> bytes:
    body = json.loads(data[20:])
    where = rnd.choice(["top", "layer", "meta"])
    if where == "top":
        body[rnd.choice(sorted(body))] = rnd.choice(JUNK)
    elif where == "layer" and isinstance(body.get("layers"), list) and body["layers"]:
        entry = rnd.choice(body["layers"])
        entry[rnd.choice(["offset", "length", "checksum"])] = rnd.choice(JUNK)
    else:
        body["meta"] = {"token_dim": rnd.choice(JUNK)}
    return resealed(body)


def resealed(body: dict) -> bytes:
    """Manifest bytes with a valid (unkeyed) self-checksum."""
    raw = json.dumps(body).encode()
    return b"VCMF" + hashlib.blake2b(raw, digest_size=16).digest() + raw


def payload_mutation(rnd: random.Random, data: bytes) -> bytes:
    (hlen,) = struct.unpack_from("<I", data, 4)
    header = json.loads(data[8 : 8 + hlen])
    field = rnd.choice(["meta", "layers", "v"])
    header[field] = rnd.choice(JUNK + [[[-1, 5]], [[0, 1 << 40]], [["0", 1]]])
    body = json.dumps(header).encode()
    return data[:4] + struct.pack("<I", len(body)) + body + data[8 + hlen :]


def tampered_consistently(store, objects: dict, key: str, new: bytes) -> dict:
    """What a writer without the key can do about a changed payload: redo every plain checksum of the
    manifests that name it (size, whole and per-layer blake2b) and their self-checksums."""
    out = {key: new}
    for mkey, mdata in objects.items():
        if "@blob%" in mkey:
            continue
        body = json.loads(mdata[20:])
        if body.get("payload_key") != key:
            continue
        body.update(algo="blake2b", mac="", size=len(new), checksum=checksum(new))
        for e in body["layers"]:
            e["checksum"] = checksum(new[e["offset"] : e["offset"] + e["length"]])
        out[mkey] = resealed(body)
    return out


async def read_all(store: DualCopyStore, tokens):
    """Every reader, each outcome: a value, or the StoreError it raised (anything else escapes)."""
    out = {}
    for name, call in (
        ("lookup", store.lookup(tokens)),
        ("has", store.has_compressed(tokens, SPEC)),
        ("comp", store.get_compressed(tokens, SPEC)),
        ("full", store.get_full(tokens)),
    ):
        try:
            out[name] = await call
        except StoreError as e:
            out[name] = e
    return out


def same_full(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


def same_comp(a, b) -> bool:
    return a[0] == b[0] and all(
        x.keys() == y.keys() and all(torch.equal(x[n], y[n]) for n in x) for x, y in zip(a[1], b[1])
    )


def check(got: dict, want: dict, label: str) -> bool:
    """Asserts nothing wrong was served; returns whether this read was a miss somewhere."""
    assert isinstance(got["lookup"], StoreError) or got["lookup"] in (0, 64, 128, 150), label
    assert isinstance(got["lookup"], StoreError) or got["lookup"] <= want["lookup"], label
    comp, full = got["comp"], got["full"]
    assert comp is None or isinstance(comp, StoreError) or same_comp(comp, want["comp"]), f"{label}: wrong compressed"
    assert isinstance(full, StoreError) or same_full(full, want["full"]), f"{label}: wrong full copy"
    return comp is None or isinstance(comp, StoreError) or isinstance(full, StoreError) or got["lookup"] < 150


@pytest.mark.parametrize("mac_key", [None, KEY], ids=["plain", "mac"])
def test_store_readers_fuzz(memory_url, mac_key):
    from storage_backends import open_backend

    tokens = random_tokens(150, seed=3)
    kv = random_kv(2, 3, 150, 4, torch.float16, seed=3)
    g = torch.Generator().manual_seed(3)
    comp = {
        SPEC: (
            {"bits": 4, "note": "fuzz"},
            [{"q": torch.randint(0, 255, (3, 150, 2), generator=g, dtype=torch.uint8)} for _ in range(2)],
        )
    }
    rnd = random.Random(2024 + (mac_key is not None))

    async def go():
        raw = open_backend(memory_url)
        keyed = {"mac_key": mac_key} if mac_key is not None else {}
        async with DualCopyStore(memory_url, MODEL, torch.float16, chunk_size=64, **keyed) as s:
            await s.put_prefix(tokens, kv, comp)
            want = await read_all(s, tokens)
            assert want["lookup"] == 150 and want["has"] is True
            objects = {k: v for k, v in raw._data.items()}
            keys = sorted(objects)
            misses = 0
            for i in range(300):
                key = rnd.choice(keys)
                label, new = mutations(rnd, objects[key], "@blob%" not in key)
                changes = {key: new}
                if mac_key is not None and label == "payload header" and rnd.random() < 0.5:
                    label, changes = "consistent tampering", tampered_consistently(s, objects, key, new)
                for k, v in changes.items():
                    await (raw.delete(k) if v is None else raw.put(k, v))
                got = await read_all(s, tokens)
                misses += check(got, want, f"case {i} ({label} of {key})")
                if label == "consistent tampering":  # the MAC makes the tampered copy a miss
                    hit = got["comp"] if f"@copy%{SPEC}@" in key else got["full"]
                    assert hit is None or isinstance(hit, StoreError), f"case {i}: tampering accepted"
                for k in changes:
                    await raw.put(k, objects[k])
            again = await read_all(s, tokens)
            assert again["lookup"] == 150 and same_full(again["full"], want["full"])
            return misses

    misses = run(go(), timeout=600)
    assert misses > 150  # the mutations mostly hit something a reader needs (not a vacuous loop)


def test_parsers_fuzz_with_random_bytes():
    """The parsers alone, on random bytes and random prefixes/suffixes of real objects."""
    from storage_backends import serialize
    from storage_backends.base import CorruptObject

    rnd = random.Random(7)
    payload, _ = serialize({"a": 1}, [{"x": torch.arange(6.0)}, {"y": torch.ones(2, 3)}])
    manifest = Manifest(
        key="k", copy="full", model="m", dtype="half", payload_key="p", size=len(payload), checksum=checksum(payload),
        layers=[], start_token=0, end_token=1,
    ).to_bytes()  # fmt: skip
    for i in range(3000):
        if i % 3 == 2:  # well-framed objects whose JSON is any value: a valid self-checksum, a random body
            body = json.dumps(random_json(rnd)).encode()
            data = rnd.choice(
                [
                    b"VCMF" + hashlib.blake2b(body, digest_size=16).digest() + body,
                    b"VCLP" + struct.pack("<I", len(body)) + body + rnd.randbytes(rnd.randint(0, 64)),
                ]
            )
        else:
            base = rnd.choice([payload, manifest, b"VCLP", b"VCMF", b""])
            cut = rnd.randrange(len(base) + 1)
            data = base[:cut] + rnd.randbytes(rnd.randint(0, 64)) if rnd.random() < 0.7 else rnd.randbytes(50)
        for parse in (deserialize, read_header, Manifest.from_bytes):
            try:
                parse(data)
            except CorruptObject:
                pass


def random_json(rnd: random.Random, depth: int = 0):
    """Any JSON value, biased towards the shapes of our headers (dicts with their field names)."""
    names = ["kind", "version", "layers", "meta", "v", "size", "key", "offset", "length", "checksum", "algo"]
    kind = rnd.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return rnd.choice([None, True, False])
    if kind == 1:
        return rnd.choice([0, -1, 1, 1 << 70, rnd.randint(-10, 10**6)])
    if kind == 2:
        return rnd.choice([0.5, -2.5, 1e308])
    if kind in (3, 4):
        return rnd.choice(["", "x", "vericache.manifest", "blake2b", "\u00e9"])
    if kind == 5:
        return [random_json(rnd, depth + 1) for _ in range(rnd.randint(0, 4))]
    body = {rnd.choice(names): random_json(rnd, depth + 1) for _ in range(rnd.randint(0, 6))}
    if rnd.random() < 0.5:
        body.update(kind="vericache.manifest", version=1)
    return body
