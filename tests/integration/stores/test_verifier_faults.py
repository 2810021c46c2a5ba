"""Verifier faults, seen from a drafter (RemotePrefixCache in this process) on the real Redis: the verifier
down, hung, answering garbage, restarted mid-request, or unable to reach its store. In every case the
output is plain full-KV greedy, token for token: the drafter fetches the full copy itself and finishes
locally from the tokens verified so far, and logs why."""

from __future__ import annotations

import concurrent.futures
import os
import time
import uuid
from types import SimpleNamespace

import pytest
from verifier_procs import client_env, fake_verifier, seed_store, usage, verifier

from vericache_connector.data import load_prompt
from vericache_connector.engine.speculative import DecodeConfig
from vericache_connector.remote import RemoteCacheConfig, RemotePrefixCache

from net import free_port
from stores import closed_port, need

pytest.importorskip("zmq", reason="pyzmq is not installed (it comes with vLLM)")
pytestmark = pytest.mark.slow

CFG = DecodeConfig(max_new_tokens=24, draft_k=8, stop_at_eos=False)
LONG = DecodeConfig(max_new_tokens=48, draft_k=4, stop_at_eos=False)


@pytest.fixture(scope="module")
def env(engine, tmp_path_factory):
    base = os.environ.get("VERICACHE_REDIS_URL")
    need(bool(base), "VERICACHE_REDIS_URL is not set (start redis with: source .ci/services.sh)")
    store = f"{base}?prefix=tf{uuid.uuid4().hex[:10]}:"
    ids = engine.encode(load_prompt("graphlib_py"))[:1100]
    seed_store(engine, store, ids)
    pre = engine.prefill(ids)  # generate_full copies it: one prefill serves both references
    os.environ.update(client_env())
    try:
        yield SimpleNamespace(
            store=store,
            ids=ids,
            logs=tmp_path_factory.mktemp("faults"),
            ref={c.max_new_tokens: engine.generate_full([pre], c)[0] for c in (CFG, LONG)},
        )
    finally:
        for name in client_env():
            os.environ.pop(name, None)


def ask(engine, env, verifier_url: str, decode=CFG, timeout_s: float = 2.0, load_timeout_s: float | None = None):
    cfg = RemoteCacheConfig(
        url=env.store,
        verifier=verifier_url,
        verifier_timeout_s=timeout_s,
        verifier_load_timeout_s=load_timeout_s or timeout_s,
        timeout_s=30.0,
    )
    with RemotePrefixCache(engine, cfg) as cache:
        return cache.generate(env.ids, decode)


def said(caplog, *words: str) -> bool:
    text = " | ".join(r.getMessage() for r in caplog.records if r.name == "vericache.remote" and r.levelno >= 30)
    return all(w in text for w in words)


def test_verifier_down(engine, env, caplog):
    res = ask(engine, env, f"tcp://127.0.0.1:{closed_port()}")
    assert res.tokens == env.ref[24]
    assert res.path == "hit" and res.bytes_full > 0  # no verifier for this request: today's compressed-first hit
    assert said(caplog, "not used", "not reachable")


def test_verifier_hung(engine, env, caplog):
    fake = fake_verifier("silent", str(env.logs / "silent.log"))
    try:
        t0 = time.monotonic()
        res = ask(engine, env, fake.url, timeout_s=0.5, load_timeout_s=1.5)  # silent on the opening call
    finally:
        fake.stop()
    assert res.tokens == env.ref[24]
    assert res.path == "verifier-fallback" and res.bytes_full > 0 and "no answer within 1.5s" in res.error
    assert said(caplog, "failed after 0 verified tokens", "fetching the full copy and finishing locally")
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("mode", ["bytes", "range", "frames"])
def test_verifier_answers_garbage(engine, env, mode, caplog):
    fake = fake_verifier(mode, str(env.logs / f"{mode}.log"))
    try:
        res = ask(engine, env, fake.url)
    finally:
        fake.stop()
    assert res.tokens == env.ref[24]
    assert res.path == "verifier-fallback" and "BadAnswer" in res.error, res.error
    assert said(caplog, "fetching the full copy")


def test_verifier_restarted_mid_request(engine, env, caplog):
    """Killed after a few verified rounds and started again on the same port: the request in flight finishes
    locally, exact; the next one is verified by the new process (ZMQ reconnects by itself)."""
    port = free_port()
    log = str(env.logs / "restart.log")
    v = verifier(env.store, log, port=port)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        running = pool.submit(ask, engine, env, v.url, LONG, 3.0)
        deadline = time.monotonic() + 120
        while usage(v.url).calls < 3:
            assert time.monotonic() < deadline and not running.done(), "no verified rounds"
            time.sleep(0.05)
        v.kill()
        v = verifier(env.store, log + ".2", port=port)
        first = running.result(300)
        second = ask(engine, env, v.url, LONG, 30.0)
    finally:
        pool.shutdown(wait=False)
        v.stop()
    assert first.tokens == env.ref[48] and second.tokens == env.ref[48]
    if first.path != "verified":  # the kill landed while a call was in flight (almost always)
        assert first.path == "verifier-fallback", first.error
        assert said(caplog, "fetching the full copy and finishing locally")
    assert second.path == "verified", second.error


def test_verifiers_store_down(engine, env, caplog):
    """The verifier cannot load the full copy (its store is gone): it says so, the drafter finishes locally
    (its own store still answers)."""
    v = verifier(f"redis://127.0.0.1:{closed_port()}/0", str(env.logs / "nostore.log"))
    try:
        res = ask(engine, env, v.url, timeout_s=30.0)
        u = usage(v.url)
    finally:
        v.stop()
    assert res.tokens == env.ref[24]
    assert res.path == "verifier-fallback" and "(store)" in res.error, res.error
    assert u.failures.get("store") == 1 and u.residents == 0
    assert said(caplog, "full KV not loaded")
