"""The LMCache 0.5.x remote_storage_plugins connector, driven by LMCache's own StorageManager (CPU)."""

import asyncio
import json
import logging
import random
import struct
import threading
import time
import zlib

import pytest
import torch

from net import wait_until
from stores import closed_port, has_module, need, run

PLUGIN = "vericache"


@pytest.fixture(autouse=True)
def _lmcache():
    need(
        has_module("lmcache"),
        "lmcache is not installed (see .ci/services.sh: pip install --no-deps lmcache==0.5.6 + minimal deps)",
    )


def make_manager(url: str, **plugin_opts):
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.storage_manager import StorageManager

    config = LMCacheEngineConfig.from_defaults(
        chunk_size=256, local_cpu=True, max_local_cpu_size=0.05, lmcache_instance_id="vc-test"
    )
    config.remote_storage_plugins = [PLUGIN]
    config.extra_config = {
        f"remote_storage_plugin.{PLUGIN}.module_path": "vericache_connector.integration.lmcache.plugin",
        f"remote_storage_plugin.{PLUGIN}.class_name": "VeriCacheRemoteConnector",
        f"remote_storage_plugin.{PLUGIN}.url": url,
        **{f"remote_storage_plugin.{PLUGIN}.{k}": v for k, v in plugin_opts.items()},
    }
    meta = LMCacheMetadata(
        model_name="smol",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.float16,
        kv_shape=(4, 2, 256, 3, 64),
        role="worker",
    )
    return StorageManager(config, meta, EventManager()), meta


def close_within(manager, seconds: float = 20) -> None:
    t = threading.Thread(target=manager.close, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"StorageManager.close() hung for more than {seconds}s"


def put_chunks(manager, meta, n=3):
    from lmcache.utils import CacheEngineKey

    keys = [CacheEngineKey("smol", 1, 0, 1000 + i, torch.float16) for i in range(n)]
    objs = []
    for i in range(n):
        obj = manager.allocate(meta.get_shapes(), meta.get_dtypes())
        obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=torch.Generator().manual_seed(i)).half())
        objs.append(obj)
    ref = [o.tensor.clone() for o in objs]
    manager.batched_put(keys, objs)
    return keys, ref


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_storage_manager_round_trip_through_plugin(kind, request):
    from storage_backends import open_backend
    from vericache_connector.integration.lmcache.plugin import VeriCacheRemoteConnector

    url = request.getfixturevalue(f"{kind}_url")
    manager, meta = make_manager(url)
    try:
        remote = manager.storage_backends[f"RemoteBackend-{PLUGIN}"]
        connector = getattr(remote.connection, "_connector", remote.connection)
        assert isinstance(connector, VeriCacheRemoteConnector) and connector.url == url
        keys, ref = put_chunks(manager, meta)
        assert wait_until(lambda: all(remote.contains(k) for k in keys), 10)
        from lmcache.utils import CacheEngineKey

        assert not remote.contains(CacheEngineKey("smol", 1, 0, 999, torch.float16))
        for key, expected in zip(keys, ref):
            got = remote.get_blocking(key)  # straight from our store, not the local CPU cache
            assert got is not None and torch.equal(got.tensor, expected)
            got.ref_count_down()
        stored = run(open_backend(url).get_many([k.to_string() for k in keys]))
        assert all(v is not None for v in stored)  # LMCache's own key strings
        header, raw = VeriCacheRemoteConnector.decode(stored[0])
        assert header["dtypes"] == ["float16"] and len(raw) == ref[0].numel() * 2
    finally:
        close_within(manager)


def test_corrupt_object_is_reported_as_a_miss(memory_url):
    from storage_backends import open_backend

    manager, meta = make_manager(memory_url)
    try:
        remote = manager.storage_backends[f"RemoteBackend-{PLUGIN}"]
        keys, _ = put_chunks(manager, meta, n=1)
        assert wait_until(lambda: remote.contains(keys[0]), 10)
        backend = open_backend(memory_url)
        data = bytearray(run(backend.get(keys[0].to_string())))
        data[-5] ^= 0xFF
        run(backend.put(keys[0].to_string(), bytes(data)))
        assert remote.get_blocking(keys[0]) is None
    finally:
        close_within(manager)


def test_store_down_is_a_miss_and_close_does_not_hang():
    need(has_module("redis"), "python package 'redis' is not installed")
    manager, meta = make_manager(f"redis://127.0.0.1:{closed_port()}/0", timeout_s=1, connect_timeout_s=0.5)
    try:
        remote = manager.storage_backends[f"RemoteBackend-{PLUGIN}"]
        keys, _ = put_chunks(manager, meta, n=1)  # logged, not raised
        t = time.monotonic()
        assert not remote.contains(keys[0])
        assert remote.get_blocking(keys[0]) is None
        assert time.monotonic() - t < 10
    finally:
        close_within(manager)


def test_missing_url_is_a_clear_error(monkeypatch):
    from types import SimpleNamespace

    from vericache_connector.integration.lmcache.plugin import resolve_plugin_options

    monkeypatch.delenv("VERICACHE_STORE_URL", raising=False)
    with pytest.raises(ValueError, match="store URL"):
        resolve_plugin_options(
            SimpleNamespace(extra_config={}, remote_storage_plugins=[PLUGIN]), "VeriCacheRemoteConnector"
        )
    opts = resolve_plugin_options(
        SimpleNamespace(
            extra_config={
                "remote_storage_plugin.x.class_name": "VeriCacheRemoteConnector",
                "remote_storage_plugin.x.module_path": "m",
                "remote_storage_plugin.x.url": "local://",
                "remote_storage_plugin.x.timeout_s": 3,
            },
            remote_storage_plugins=["x"],
        ),
        "VeriCacheRemoteConnector",
    )
    assert opts == {"url": "local://", "timeout_s": 3}


# -- hardening: any bad object is a miss; model identity; secrets ---------------------------------------


def connector_of(manager):
    remote = manager.storage_backends[f"RemoteBackend-{PLUGIN}"]
    return getattr(remote.connection, "_connector", remote.connection)


def get_now(connector, key):
    """connector.get(key) on LMCache's loop: what LMCache awaits (an exception here escapes to LMCache)."""
    return asyncio.run_coroutine_threadsafe(connector.get(key), connector.loop).result(20)


def craft(data: bytes, raw: bytes | None = None, **changes) -> bytes:
    """A stored object with header fields changed (and raw bytes replaced) and a VALID crc32, as anyone
    who can write to the store can make it. Knows the format before this change (b"VCLM": the crc covers
    the raw bytes only) and after (b"VCL2": the other header fields too)."""
    magic, hlen = struct.unpack_from("<4sI", data)
    header = json.loads(data[8 : 8 + hlen])
    raw = data[8 + hlen :] if raw is None else raw
    header.update(changes)
    if magic == b"VCLM":
        header["crc32"] = zlib.crc32(raw)
    else:
        fields = {k: header[k] for k in ("model", "shapes", "dtypes", "fmt", "length")}
        head = json.dumps(fields, separators=(",", ":"), sort_keys=True).encode()
        header["crc32"] = zlib.crc32(raw, zlib.crc32(head))
    body = json.dumps(header).encode()
    return struct.pack("<4sI", magic, len(body)) + body + raw


def stored(url, key_str):
    from storage_backends import open_backend

    return run(open_backend(url).get(key_str))


def put_raw(url, key_str, data):
    from storage_backends import open_backend

    run(open_backend(url).put(key_str, data))


def assert_each_is_a_miss(caplog, url: str, connector, key, cases: dict[str, bytes]) -> None:
    """Each case's bytes, stored in turn as the object of `key` (under LMCache's own key string), are a miss
    on get, with a warning saying so."""
    with caplog.at_level(logging.WARNING):
        for name, data in cases.items():
            put_raw(url, key.to_string(), data)
            caplog.clear()
            assert get_now(connector, key) is None, name
            assert any("miss" in r.getMessage() for r in caplog.records), name


def test_crafted_objects_with_a_valid_crc_are_misses(memory_url, caplog):
    """Issue 13, case 5: a header the CRC does not protect, or a payload shorter than its shapes, used to
    escape get as an exception or hand back stale buffer bytes. Now each is a miss with a warning."""
    manager, meta = make_manager(memory_url)
    try:
        connector = connector_of(manager)
        keys, ref = put_chunks(manager, meta, n=1)
        key_str = keys[0].to_string()  # no model_dir: LMCache's own key
        assert wait_until(lambda: stored(memory_url, key_str) is not None, 10)
        good = stored(memory_url, key_str)
        got = get_now(connector, keys[0])
        assert got is not None and torch.equal(got.tensor, ref[0])
        got.ref_count_down()
        raw = good[8 + struct.unpack_from("<I", good, 4)[0] :]
        half = raw[: len(raw) // 2]
        cases = {
            "shape not an int": craft(good, shapes=[[2, 2, "x"]]),
            "unknown dtype": craft(good, dtypes=["not_a_dtype"]),
            "unknown format": craft(good, fmt=999),
            "shapes not a list": craft(good, shapes=7),
            "short payload": craft(good, raw=half, length=len(half)),
            "huge shape": craft(good, shapes=[[1 << 20, 1 << 20, 1 << 20]]),
            "other dtype": craft(good, dtypes=["bfloat16"]),
        }
        assert_each_is_a_miss(caplog, memory_url, connector, keys[0], cases)
        put_raw(memory_url, key_str, good)
        got = get_now(connector, keys[0])
        assert got is not None and torch.equal(got.tensor, ref[0])
        got.ref_count_down()
    finally:
        close_within(manager)


def test_lmcache_objects_fuzz(memory_url):
    """Random bytes, truncations, bit flips and header mutations (with a valid crc) of a real stored
    object, seeded: get never raises, and whatever it returns is the original chunk."""
    manager, meta = make_manager(memory_url)
    rnd = random.Random(13)
    junk = [None, -1, 0, 1 << 70, "x", [], {}, [[]], [[-1]], 1.5, True, [[2, 256, 3, 64]], ["float16"] * 3]
    try:
        connector = connector_of(manager)
        keys, ref = put_chunks(manager, meta, n=1)
        key_str = keys[0].to_string()  # no model_dir: LMCache's own key
        assert wait_until(lambda: stored(memory_url, key_str) is not None, 10)
        good = stored(memory_url, key_str)
        served = misses = 0
        for i in range(300):
            kind = i % 5
            data = bytearray(good)
            if kind == 0:
                for _ in range(rnd.randint(1, 4)):
                    data[rnd.randrange(len(data))] ^= 1 << rnd.randrange(8)
            elif kind == 1:
                data = data[: rnd.randrange(len(data))]
            elif kind == 2:
                data = bytearray(rnd.randbytes(rnd.randint(0, 600)))
                if rnd.random() < 0.5:
                    data[:4] = b"VCL2"
            elif kind == 3:
                field = rnd.choice(["model", "shapes", "dtypes", "fmt", "length"])
                data = bytearray(craft(good, **{field: rnd.choice(junk)}))
            else:
                data = data + rnd.randbytes(rnd.randint(1, 64))
            put_raw(memory_url, key_str, bytes(data))
            got = get_now(connector, keys[0])  # raises here if anything escapes
            if got is None:
                misses += 1
            else:
                assert bytes(data) == good or torch.equal(got.tensor, ref[0]), f"case {i}: wrong data served"
                served += 1
                got.ref_count_down()
        assert misses > 250
    finally:
        close_within(manager)


def make_model_dir(path, config: dict):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer.json").write_text("{}")
    return str(path)


def test_model_identity_names_the_keys_and_a_mismatch_is_a_miss(memory_url, tmp_path, caplog):
    """Two checkpoints under one folder name never share entries: the keys carry
    identity.dir_model_id(model_dir, kv_dtype); an object recorded for another model is a miss."""
    from lmcache.utils import CacheEngineKey

    from storage_backends.identity import dir_model_id

    dir_a = make_model_dir(tmp_path / "runA" / "checkpoint", {"hidden": 1})
    dir_b = make_model_dir(tmp_path / "runB" / "checkpoint", {"hidden": 2})
    id_a, id_b = dir_model_id(dir_a, torch.float16), dir_model_id(dir_b, torch.float16)
    assert id_a != id_b and id_a.startswith("checkpoint.") and id_b.startswith("checkpoint.")
    assert dir_model_id(dir_a, "half") == id_a == dir_model_id(dir_a, "float16")  # one spelling
    manager_a, meta = make_manager(memory_url, model_dir=dir_a)
    manager_b, _ = make_manager(memory_url, model_dir=dir_b)
    try:
        a, b = connector_of(manager_a), connector_of(manager_b)
        assert a.model_id == id_a and b.model_id == id_b
        keys, ref = put_chunks(manager_a, meta, n=1)
        key_a = keys[0].to_string().replace("smol@", f"{id_a}@", 1)
        assert wait_until(lambda: stored(memory_url, key_a) is not None, 10)
        assert stored(memory_url, keys[0].to_string()) is None  # LMCache's own name is not used
        got = get_now(a, keys[0])
        assert got is not None and torch.equal(got.tensor, ref[0])
        got.ref_count_down()
        assert get_now(b, keys[0]) is None  # other weights: another key
        key_b = keys[0].to_string().replace("smol@", f"{id_b}@", 1)
        put_raw(memory_url, key_b, stored(memory_url, key_a))  # A's object filed under B's key
        with caplog.at_level(logging.WARNING):
            assert get_now(b, keys[0]) is None
        assert any("written for model" in r.getMessage() for r in caplog.records)
        other = CacheEngineKey("smol", 1, 0, 4242, torch.float16)
        assert b._key(other)[0].startswith(f"{id_b}@1@0@")
    finally:
        close_within(manager_a)
        close_within(manager_b)
    from vericache_connector.integration.lmcache.plugin import resolve_model_id

    with pytest.raises(ValueError, match="not both"):
        resolve_model_id({"model_dir": dir_a, "model_id": "x.1"}, torch.float16)
    with pytest.raises(ValueError, match="model_id"):
        resolve_model_id({"model_id": "a@b"}, torch.float16)
    assert resolve_model_id({"model_id": "m.0123"}, torch.float16) == "m.0123"
    assert resolve_model_id({}, torch.float16) is None


def test_mac_key_both_ways(memory_url, tmp_path):
    (tmp_path / "key").write_bytes(b"plugin-mac-key-0123456789abcdef\n")
    (tmp_path / "other").write_bytes(b"another-mac-key-0123456789abcdef")
    keyed, meta = make_manager(memory_url, mac_key_file=str(tmp_path / "key"))
    plain, _ = make_manager(memory_url)
    wrong, _ = make_manager(memory_url, mac_key_file=str(tmp_path / "other"))
    try:
        keys, ref = put_chunks(keyed, meta, n=1)
        assert wait_until(lambda: stored(memory_url, keys[0].to_string()) is not None, 10)
        got = get_now(connector_of(keyed), keys[0])
        assert got is not None and torch.equal(got.tensor, ref[0])
        got.ref_count_down()
        assert get_now(connector_of(plain), keys[0]) is None  # keyed object, reader without the key
        assert get_now(connector_of(wrong), keys[0]) is None
        plain_keys, _ = put_chunks(plain, meta, n=2)  # an object written without the key
        assert wait_until(lambda: stored(memory_url, plain_keys[1].to_string()) is not None, 10)
        put_raw(memory_url, keys[0].to_string(), stored(memory_url, plain_keys[1].to_string()))
        assert get_now(connector_of(keyed), keys[0]) is None  # planted: a miss for the keyed reader
        assert "plugin-mac" not in repr(connector_of(keyed))
    finally:
        for m in (keyed, plain, wrong):
            close_within(m)


def test_plugin_repr_and_logs_hide_the_store_password(caplog):
    need(has_module("redis"), "python package 'redis' is not installed")
    url = f"redis://:TOP%2FSECRET@127.0.0.1:{closed_port()}/0"
    with caplog.at_level(logging.DEBUG):
        manager, meta = make_manager(url, timeout_s=1, connect_timeout_s=0.5)
        try:
            connector = connector_of(manager)
            keys, _ = put_chunks(manager, meta, n=1)  # fails: logged
            assert get_now(connector, keys[0]) is None
            assert "SECRET" not in repr(connector) and "SECRET" not in connector.url
        finally:
            close_within(manager)
    assert not [r for r in caplog.records if "SECRET" in r.getMessage()]
