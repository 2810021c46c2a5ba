"""Bounded stores without a server (issue 40, item 2): local:///dir?max_bytes= (LRU by chunk, both copies
together, never past its capacity), `vericache store stats / evict`, the options' checks, and the URL
forms of Redis Cluster and Sentinel (item 3; their servers: tests/integration/stores/test_store_redis_ha.py)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from storage_backends import DualCopyStore, open_backend
from storage_backends.base import ObjectInfo
from storage_backends.inventory import group_of, parse_key, plan, summarize
from vericache_connector import cli

from stores import random_kv, random_tokens, run

CHUNK = 32
SPEC = "kivi4"


def disk_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)


async def put(st: DualCopyStore, seed: int, tokens: int = 96) -> list[int]:
    ids = random_tokens(tokens, seed=seed)
    comp = ({"seed": seed}, random_kv(2, 2, 8, 32, torch.float32, seed=seed))
    await st.put_prefix(ids, random_kv(2, 2, tokens, 32, torch.float32, seed=seed), {SPEC: comp})
    return ids


def test_a_bounded_disk_store_stays_under_max_bytes_and_evicts_whole_chunks(tmp_path):
    root = tmp_path / "store"
    cap = 700_000  # a prefix's two copies: 107 kB; room for six

    async def go():
        async with DualCopyStore(f"local://{root}?max_bytes={cap}", "m", torch.float32, CHUNK) as st:
            prompts = []
            for i in range(20):
                prompts.append(await put(st, i))
                assert disk_bytes(root) <= cap, f"past max_bytes after prefix {i}"
                # prompt 0 is asked again all along: it stays
                assert await st.lookup(prompts[0]) == 96 and await st.has_compressed(prompts[0], SPEC)
            states = [(await st.lookup(p), await st.has_compressed(p, SPEC)) for p in prompts]
            objects = [o async for o in st.backend.scan()]
        return states, objects

    states, objects = run(go())
    assert states[0] == (96, True) and states[-1] == (96, True)
    assert any(s == (0, False) for s in states), "nothing was evicted: the test did not fill the store"
    # both copies together: never a compressed copy without its full copy, never a payload without its manifest
    assert all(found == 96 for found, comp in states if comp), states
    assert summarize(objects).orphans == 0

    # a prefix goes from its end: what stays of one is a leading run of its chunks, still usable
    async def leading(ids):
        async with DualCopyStore(f"local://{root}", "m", torch.float32, CHUNK) as st:
            kept = [await st.backend.exists(c.copy("full")) for c in st.keys.chunks(ids)]
        return kept

    for ids in [random_tokens(96, seed=i) for i in range(20)]:
        kept = run(leading(ids))
        assert kept == sorted(kept, reverse=True), kept


def test_a_hit_makes_a_prefix_recent(tmp_path):
    url = f"local://{tmp_path}/s?max_bytes=250000"

    async def go():
        async with DualCopyStore(url, "m", torch.float32, CHUNK) as st:
            a, b = await put(st, 100), await put(st, 101)
            await st.lookup(a)  # a used after b was written
            await put(st, 102)  # 3 prefixes do not fit: the least recently used goes
            return await st.lookup(a), await st.lookup(b)

    assert run(go()) == (96, 0)


def test_an_object_bigger_than_the_store_is_refused(tmp_path):
    from storage_backends import StoreError

    async def go():
        b = open_backend(f"local://{tmp_path}/s?max_bytes=1000")
        await b.put("small", b"x" * 10)
        with pytest.raises(StoreError, match="does not fit max_bytes=1000"):
            await b.put("big", b"x" * 2000)
        return await b.get("small")

    assert run(go()) == b"x" * 10


def test_long_keys_keep_their_chunk(tmp_path):
    """Keys past a file name's length live in folders; scan gives the key back, so its chunk is known."""
    key = "m" * 150 + "@1@0@abc@float@copy%" + "k" * 120

    async def go():
        b = open_backend(f"local://{tmp_path}/s")
        await b.put(key, b"1")
        await b.put(key + "@blob%ff", b"22")
        return await b.get(key), sorted([o async for o in b.scan()], key=lambda o: o.key)

    value, objects = run(go())
    assert value == b"1" and [o.key for o in objects] == [key, key + "@blob%ff"]
    assert {group_of(o.key) for o in objects} == {"m" * 150 + "@1@0@abc@float"}


def test_plan_takes_least_recent_chunks_manifests_first():
    objs = [
        ObjectInfo("a@copy%full", 10, 1.0),
        ObjectInfo("a@copy%full@blob%1", 100, 1.0),
        ObjectInfo("b@copy%full@blob%2", 100, 5.0),
        ObjectInfo("b@copy%full", 10, 5.0),
        ObjectInfo("c@copy%full", 10, 9.0),
    ]
    assert [g.name for g in plan(objs, max_bytes=200)] == ["a"]
    assert [g.keys for g in plan(objs, max_bytes=10)] == [
        ["a@copy%full", "a@copy%full@blob%1"],
        ["b@copy%full", "b@copy%full@blob%2"],
    ]
    assert [g.name for g in plan(objs, older_than_s=3, now=10)] == ["a", "b"]
    assert plan(objs, max_bytes=10, keep="a")[0].name == "b"
    info = parse_key("mod@1@0@ff@float@copy%kivi:bits=4@blob%00")
    assert (info.model, info.copy, info.payload, info.manifest_key) == (
        "mod",
        "kivi:bits=4",
        True,
        "mod@1@0@ff@float@copy%kivi:bits=4",
    )


def test_store_stats_and_evict_commands(tmp_path, capsys):
    root = tmp_path / "s"

    async def fill():
        async with DualCopyStore(f"local://{root}", "m", torch.float32, CHUNK) as st:
            for i in range(3):
                await put(st, i)
            await st.backend.put("m@1@0@dead@float@copy%full@blob%00", b"x" * 50)  # an orphan

    run(fill())
    assert cli.main(["store", "stats", f"local://{root}", "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    full, comp = st["copies"]
    assert (full["copy"], full["entries"], comp["copy"], comp["entries"]) == ("full", 9, SPEC, 3)
    assert st["orphans"] == 1 and st["bytes"] == disk_bytes(root)
    assert full["oldest"] <= full["newest"]
    assert cli.main(["store", "evict", f"local://{root}", "--max-bytes", "100k", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["chunks"] > 0 and got["left_bytes"] == disk_bytes(root) <= 100 * 1024
    assert cli.main(["store", "evict", f"local://{root}", "--older-than", "0"]) == 0
    assert "deleted" in capsys.readouterr().out and disk_bytes(root) == 0


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["store", "evict", "redis://:pw@127.0.0.1:1/0", "--max-bytes", "1"], "Redis evicts by itself"),
        (["store", "stats", "local://mem"], "one process's memory"),
        (["store", "evict", "local:///tmp/x", "--max-bytes", "lots"], "'lots' is not a size"),
        (["store", "evict", "local:///tmp/x", "--older-than", "soon"], "'soon' is not a duration"),
        (["store", "stats", "local:///tmp/x?max_bytes=0"], "max_bytes='0' must be > 0"),
        (["store", "stats", "redis://127.0.0.1:1/0?ttl_s=-1"], "ttl_s='-1' must be > 0"),
        (["store", "stats", "s3://b/p?ttl_s=x"], "ttl_s='x' is not a number"),
    ],
)
def test_store_command_errors_name_the_value(capsys, argv, needle, monkeypatch):
    monkeypatch.delenv("VERICACHE_STORE_URL", raising=False)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "pw" not in err


def test_max_bytes_is_for_disk_stores():
    with pytest.raises(ValueError, match="max_bytes=5 is for disk stores"):
        open_backend("local://name?max_bytes=5")


# ---- Redis Cluster and Sentinel URLs (no server: nothing connects before the first call) -------------
def test_cluster_keys_of_one_chunk_share_a_hash_slot():
    from redis.crc import key_slot

    b = open_backend("redis+cluster://:s3cret@127.0.0.1:7000,127.0.0.1:7001?prefix=vc:")
    chunk = "mod@1@0@ff@float"
    keys = [f"{chunk}@copy%full", f"{chunk}@copy%full@blob%00", f"{chunk}@copy%kivi4", f"{chunk}@copy%kivi4@blob%11"]
    slots = {key_slot(b._k(k).encode()) for k in keys}
    assert len(slots) == 1
    others = {key_slot(b._k(f"mod@1@0@{i:x}@float@copy%full").encode()) for i in range(50)}
    assert len(others) > 40  # chunks spread over the slots
    assert all(b._unk(b._k(k).encode()) == k for k in keys)
    assert (
        "s3cret" not in repr(b) and b._password == "s3cret" and b._nodes == [("127.0.0.1", 7000), ("127.0.0.1", 7001)]
    )


def test_sentinel_url_names_its_service():
    b = open_backend("redis+sentinel://u:p%40ss@10.0.0.1:26379,10.0.0.2:26379/mymaster/2?ttl_s=60")
    assert (b.service, b.db, b._user, b._password, b.ttl_s) == ("mymaster", 2, "u", "p@ss", 60.0)
    assert b._sentinels == [("10.0.0.1", 26379), ("10.0.0.2", 26379)]


@pytest.mark.parametrize(
    "url,needle",
    [
        ("redis+cluster://:pw@127.0.0.1:7000/3", "database 0 only"),
        ("redis+cluster://:pw@127.0.0.1", "is not host:port"),
        ("redis+sentinel://:pw@127.0.0.1:26379", "name the service"),
        ("redis+sentinel://:pw@127.0.0.1:26379/m/x", "name the service"),
        ("redis+cluster://127.0.0.1:7000?prefix={x}", "cannot hold"),
    ],
)
def test_bad_cluster_and_sentinel_urls(url, needle):
    with pytest.raises(ValueError, match=needle) as e:
        open_backend(url)
    assert ":pw@" not in str(e.value)


def test_the_store_config_takes_the_new_schemes():
    from vericache_connector.store import RemoteCacheConfig

    for url in ("redis+cluster://127.0.0.1:7000", "redis+sentinel://127.0.0.1:26379/m", "local:///x?max_bytes=9"):
        RemoteCacheConfig(url=url)
