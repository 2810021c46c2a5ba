"""The LMCache 0.5.x remote_storage_plugins connector, driven by LMCache's own StorageManager (CPU)."""

import threading
import time

import pytest
import torch

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
        f"remote_storage_plugin.{PLUGIN}.module_path": "storage_backends.lmcache_plugin",
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


def wait_for(pred, seconds=10):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_storage_manager_round_trip_through_plugin(kind, request):
    from storage_backends import open_backend
    from storage_backends.lmcache_plugin import VeriCacheRemoteConnector

    url = request.getfixturevalue(f"{kind}_url")
    manager, meta = make_manager(url)
    try:
        remote = manager.storage_backends[f"RemoteBackend-{PLUGIN}"]
        connector = getattr(remote.connection, "_connector", remote.connection)
        assert isinstance(connector, VeriCacheRemoteConnector) and connector.url == url
        keys, ref = put_chunks(manager, meta)
        assert wait_for(lambda: all(remote.contains(k) for k in keys))
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
        assert wait_for(lambda: remote.contains(keys[0]))
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

    from storage_backends.lmcache_plugin import resolve_plugin_options

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
