"""Clean shutdown: StoreClient.close (and RemotePrefixCache's) cancels what runs on its loop, closes the
store's connections, the loop and its executor and joins the thread; a closed cache raises at once
instead of waiting out its timeout. One test runs a whole miss/hit/close cycle under `python -X dev`
with ResourceWarning as an error, on an in-memory store and (when it runs) Redis."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from vericache_connector.engine import DecodeConfig
from vericache_connector.remote import RemoteCacheConfig, RemotePrefixCache, StoreClient

from paths import ROOT, SUPPORT
from tiny_model import tiny_engine

CFG = DecodeConfig(max_new_tokens=8, draft_k=4, stop_at_eos=False)


def ids(n: int = 80) -> list[int]:
    return [int(x) for x in torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(0))]


def test_close_joins_the_thread_and_closes_the_loop(memory_url):
    client = StoreClient(RemoteCacheConfig(url=memory_url), "m.0", torch.float32, "vericache-test-close")
    thread, loop = client._thread, client._loop
    assert client.call(client.store.lookup(ids())) == 0
    client.close()
    assert not thread.is_alive() and loop.is_closed()
    client.close()  # idempotent


def test_close_cancels_work_still_running(memory_url):
    client = StoreClient(RemoteCacheConfig(url=memory_url), "m.0", torch.float32)
    import asyncio

    fut = client.submit(asyncio.sleep(3600))
    t0 = time.perf_counter()
    client.close()
    assert time.perf_counter() - t0 < 5 and fut.cancelled()


def test_a_closed_cache_is_a_clear_error_not_a_timeout(memory_url):
    engine = tiny_engine()
    cache = RemotePrefixCache(engine, RemoteCacheConfig(url=memory_url, chunk_size=16, timeout_s=30))
    cache.generate(ids(), CFG)
    cache.close()
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="closed"):  # ClientClosed
        cache.generate(ids(), CFG)
    with pytest.raises(RuntimeError, match="closed"):
        cache.client.call(cache.store.lookup(ids()))
    assert time.perf_counter() - t0 < 1.0


SCRIPT = textwrap.dedent(
    """
    import gc, os, sys, threading
    sys.path.insert(0, {support!r})
    unraisable = []
    sys.unraisablehook = lambda u: unraisable.append(f"{{u.exc_type.__name__}}: {{u.exc_value}} in {{u.object!r}}")
    import torch
    from tiny_model import tiny_engine
    from vericache_connector.engine import DecodeConfig
    from vericache_connector.remote import RemoteCacheConfig, RemotePrefixCache

    engine = tiny_engine()
    ids = [int(x) for x in torch.randint(3, 256, (80,), generator=torch.Generator().manual_seed(0))]
    cfg = DecodeConfig(max_new_tokens=8, draft_k=4, stop_at_eos=False)
    ref = engine.generate_full([engine.prefill(ids)], cfg)[0]
    before = threading.active_count()
    for url in sys.argv[1:]:
        with RemotePrefixCache(engine, RemoteCacheConfig(url=url, chunk_size=16)) as cache:
            paths = [cache.generate(ids, cfg) for _ in range(2)]
        assert [(r.path, r.tokens) for r in paths] == [("miss", ref), ("hit", ref)], [r.path for r in paths]
        del cache, paths
        gc.collect()
        assert threading.active_count() == before, [t.name for t in threading.enumerate()]
    gc.collect()
    assert not unraisable, unraisable
    print("clean", threading.active_count())
    """
)


def test_no_resource_left_under_python_dev_mode(tmp_path):
    script = tmp_path / "cycle.py"
    script.write_text(SCRIPT.format(support=str(SUPPORT)))
    urls = ["local://devmode", f"local://{tmp_path}/store"]
    redis = os.environ.get("VERICACHE_REDIS_URL")
    if redis:
        urls.append(f"{redis}?prefix=devmode{os.getpid()}:")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-X", "dev", "-W", "error::ResourceWarning", str(script), *urls],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0 and "clean" in proc.stdout, proc.stdout + proc.stderr
    assert "ResourceWarning" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
