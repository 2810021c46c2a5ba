"""Issue 28, case 8, end to end: the verifier dies after a drafter's opening call and before its answer. The
drafter (RemotePrefixCache in this process, real model, real Redis) used to wait the whole opening-call
deadline (30 s) before finishing locally; now it notices the connection end within seconds, fetches the
full copy and finishes locally, with the full-KV greedy output token for token."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid

import pytest
from verifier_procs import client_env, fake_verifier, seed_store

from vericache_connector.data import load_prompt
from vericache_connector.engine.speculative import DecodeConfig
from vericache_connector.remote import RemoteCacheConfig, RemotePrefixCache

from stores import need

pytest.importorskip("zmq", reason="pyzmq is not installed (it comes with vLLM)")
pytestmark = pytest.mark.slow

CFG = DecodeConfig(max_new_tokens=12, draft_k=4, stop_at_eos=False)


def test_a_verifier_dying_before_its_first_answer_is_noticed_within_seconds(engine, tmp_path, monkeypatch, caplog):
    base = os.environ.get("VERICACHE_REDIS_URL")
    need(bool(base), "VERICACHE_REDIS_URL is not set (start redis with: source .ci/services.sh)")
    for name, value in client_env().items():
        monkeypatch.setenv(name, value)
    store = f"{base}?prefix=th{uuid.uuid4().hex[:10]}:"
    ids = engine.encode(load_prompt("graphlib_py"))[:300]
    seed_store(engine, store, ids)
    ref = engine.generate_full([engine.prefill(ids)], CFG)[0]
    fake = fake_verifier("silent", str(tmp_path / "silent.log"))  # takes the opening call, never answers
    cfg = RemoteCacheConfig(url=store, verifier=fake.url, verifier_timeout_s=30.0, verifier_load_timeout_s=30.0)
    killer = threading.Timer(1.0, lambda: os.killpg(fake.proc.pid, signal.SIGKILL))
    try:
        with RemotePrefixCache(engine, cfg) as cache:
            t0 = time.monotonic()
            killer.start()
            res = cache.generate(ids, CFG)
            took = time.monotonic() - t0
    finally:
        killer.cancel()
        fake.kill()
    assert res.tokens == ref
    assert res.path == "verifier-fallback" and "connection ended" in res.error, res.error
    assert took < 15, f"{took:.1f}s: the drafter waited for the 30 s deadline"  # was 30 s + the local finish
    assert "fetching the full copy and finishing locally" in caplog.text
