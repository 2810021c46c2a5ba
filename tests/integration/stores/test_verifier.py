"""Drafters + verifier as real processes on 127.0.0.1 with the real Redis: `vericache verifier` next to the
store, drafters (`vericache drafter` processes, and RemotePrefixCache in this process) that fetch only the
compressed copy. Every output is compared token for token with plain full-KV greedy decoding of the same
prompt (graphlib_py cut to 1100 tokens: 1024 stored, 76-token suffix)."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
import uuid
from types import SimpleNamespace

import pytest
from verifier_procs import TOKEN, client_env, dealer, drafter, proc_env, seed_store, usage, verifier

from vericache_connector.data import load_prompt
from vericache_connector.demo.procs import generate
from vericache_connector.engine.speculative import DecodeConfig
from vericache_connector.remote import RemoteCacheConfig, RemotePrefixCache, rpc

from stores import need

pytest.importorskip("zmq", reason="pyzmq is not installed (it comes with vLLM)")
pytestmark = pytest.mark.slow

NEW = 24
CFG = DecodeConfig(max_new_tokens=NEW, draft_k=8, stop_at_eos=False)
TTL_S = 4.0


@pytest.fixture(scope="module")
def env(engine, tmp_path_factory):
    base = os.environ.get("VERICACHE_REDIS_URL")
    need(bool(base), "VERICACHE_REDIS_URL is not set (start redis with: source .ci/services.sh)")
    store = f"{base}?prefix=tv{uuid.uuid4().hex[:10]}:"
    ids = engine.encode(load_prompt("graphlib_py"))[:1100]
    stored = seed_store(engine, store, ids)
    logs = tmp_path_factory.mktemp("verifier")
    v = verifier(store, str(logs / "verifier.log"), ttl_s=TTL_S)
    os.environ.update(client_env())  # the in-process drafters read it as pods do
    try:
        yield SimpleNamespace(
            store=store, ids=ids, stored=stored, v=v, logs=logs, ref=engine.generate_full([engine.prefill(ids)], CFG)[0]
        )
    finally:
        for name in client_env():
            os.environ.pop(name, None)
        v.stop()


def ask(engine, env, decode=CFG, **kw):
    cfg = RemoteCacheConfig(
        url=env.store, verifier=env.v.url, verifier_timeout_s=60.0, verifier_load_timeout_s=60.0, timeout_s=30.0, **kw
    )
    with RemotePrefixCache(engine, cfg) as cache:
        return cache.generate(env.ids, decode)


def test_hit_fetches_only_the_compressed_copy_and_is_exact(engine, env, caplog):
    caplog.set_level(logging.INFO, logger="vericache.remote")
    for _ in range(2):  # the second request's KV is loaded again (the first released it)
        res = ask(engine, env)
        assert res.path == "verified", (res.error, env.v.log()[-2000:])
        assert res.tokens == env.ref
        assert res.bytes_full == 0 and 0 < res.bytes_compressed < env.stored * 46080 / 3
        assert res.timings.full_arrived_s is None and res.timings.first_token_s < res.timings.total_s
        assert len(res.stats.draft_lengths) >= 2 and res.stats.draft_lengths[0] == 0  # the opening call
        # every accepted draft was drafted here; the verifier's tokens (one per call) were not
        assert res.draft_steps >= sum(res.stats.accepted[0]) >= len(res.tokens) - len(res.stats.draft_lengths)
    u = usage(env.v.url)
    assert u.loads >= 2 and u.calls >= 4 and u.released >= 2
    assert "tokens of full KV loaded" in env.v.log()
    assert "verified: 1100 prompt tokens (1024 stored), 24 new" in caplog.text


def test_sampled_request_is_verified(engine, env):
    res = ask(engine, env, DecodeConfig(max_new_tokens=12, draft_k=4, temperature=0.8, seed=5, stop_at_eos=False))
    assert res.path == "verified", res.error
    assert len(res.tokens) == 12 and all(0 <= t < engine.model.cfg.vocab_size for t in res.tokens)


@pytest.fixture(scope="module")
def drafters(env):
    logs = env.logs
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # the two model loads overlap
        procs = list(pool.map(lambda i: drafter(env.store, env.v.url, str(logs / f"drafter{i}.log")), range(2)))
    yield procs
    for p in procs:
        p.stop()


def test_two_drafter_processes_share_one_verifier(env, drafters):
    before = usage(env.v.url)
    body = {"prompt_ids": env.ids, "max_new_tokens": NEW, "draft_k": 8, "stop_at_eos": False}
    jobs = [d.url for d in drafters for _ in range(2)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda url: generate(url, body), jobs))
    for out in outs:
        assert out.get("path") == "verified", out
        assert out["tokens"] == env.ref
        assert out["bytes_full"] == 0
        assert out["draft_steps"] >= NEW - out["verify_calls"] and 0 < out["first_draft_s"] <= out["total_s"]
    after = usage(env.v.url)
    assert all("warmed up in" in d.log() for d in [*drafters, env.v])  # before serving, not on a request
    assert after.loads - before.loads >= 4 and after.calls - before.calls >= 4 * 3
    assert after.forwards - before.forwards <= after.calls - before.calls


def test_a_drafter_measures_its_options_side_by_side(env, drafters):
    """The drafter's other modes (what benchmarks/disaggregated.py compares against): the same output."""
    body = {"prompt_ids": env.ids, "max_new_tokens": NEW, "draft_k": 8, "stop_at_eos": False}
    for mode, path in (("full-kv", "fetch"), ("local", "hit"), ("recompute", "recompute")):
        out = generate(drafters[0].url, {**body, "mode": mode})
        assert (out.get("path"), out.get("tokens")) == (path, env.ref), (mode, out.get("path"), out.get("error"))
        if mode == "full-kv":  # the baseline fetched the whole full copy over this node's link
            assert out["bytes_full"] == env.stored * 46080
    for bad, words in (({"mode": "fast"}, "mode must be one of"), ({"prompt_ids": [-1]}, "prompt_ids")):
        out = generate(drafters[0].url, {**body, **bad})
        assert out["status"] == 400 and words in out["error"], out


def test_a_dying_drafter_leaves_no_state_behind(env, drafters):
    """kill -9 one drafter in the middle of a long request: the verifier frees its KV after ttl_s."""
    victim = drafters[1]
    body = {"prompt_ids": env.ids, "max_new_tokens": 400, "draft_k": 8, "stop_at_eos": False}
    pool = concurrent.futures.ThreadPoolExecutor(1)
    pending = pool.submit(generate, victim.url, body, 600)
    deadline = time.monotonic() + 120
    while usage(env.v.url).residents == 0:
        assert time.monotonic() < deadline and not pending.done(), "the request never reached the verifier"
        time.sleep(0.2)
    expired = usage(env.v.url).expired
    victim.kill()
    deadline = time.monotonic() + TTL_S + 30
    while (u := usage(env.v.url)).residents:
        assert time.monotonic() < deadline, u
        time.sleep(0.5)
    assert u.expired == expired + 1
    pool.shutdown(wait=True)  # the HTTP call ends with the process
    assert "idle for over" in env.v.log()


# ---- bad calls: a clear Failure each, and the verifier serves on -----------------------------------------
def raw_call(url: str, frames: list[bytes]):
    sock = dealer(url)
    try:
        sock.send_multipart(frames)
        assert sock.poll(30_000), "no answer"
        (body,) = sock.recv_multipart()
        return rpc.decode_answer(body)
    finally:
        sock.close(0)


def test_bad_calls_are_refused_clearly(engine, env):
    good = rpc.Verify(engine.model_name, "bad-1", 0, env.ids, env.stored, [], [], NEW)
    cases = {
        "wrong token": ([b"x" * 32, rpc.encode(good)], "auth", "token"),
        "three frames": ([TOKEN.encode(), b"a", b"b"], "malformed", "2 frames"),
        "junk body": ([TOKEN.encode(), b"\xc1junk"], "malformed", "not a verifier call"),
        "oversized": ([TOKEN.encode(), *[b"\x00" * rpc.FRAME_BYTES] * 128, b"\x00"], "too_large", "exceeds the limit"),
        "other model": ([TOKEN.encode(), rpc.encode(_with(good, model="llama.0000"))], "model", "llama.0000"),
        "bad token id": ([TOKEN.encode(), rpc.encode(_with(good, drafts=[10**7]))], "malformed", "drafts"),
        "stored not whole chunks": ([TOKEN.encode(), rpc.encode(_with(good, stored=1000))], "malformed", "stored"),
        "too many drafts": ([TOKEN.encode(), rpc.encode(_with(good, drafts=[1] * 65))], "too_large", "drafts"),
        "missing q": ([TOKEN.encode(), rpc.encode(_with(good, temperature=0.7, drafts=[1]))], "malformed", "q has"),
    }
    for name, (frames, code, words) in cases.items():
        answer = raw_call(env.v.url, frames)
        assert isinstance(answer, rpc.Failure) and answer.code == code and words in answer.message, (name, answer)
        assert TOKEN not in answer.message
    assert TOKEN not in env.v.log()
    res = ask(engine, env)  # and it still serves
    assert (res.path, res.tokens) == ("verified", env.ref), res.error


def _with(call: rpc.Verify, **kw) -> rpc.Verify:
    import msgspec

    return msgspec.structs.replace(call, **kw)


def test_the_token_comes_from_the_environment_only(engine, env, tmp_path, monkeypatch):
    monkeypatch.delenv("VERICACHE_VERIFIER_TOKEN")
    with pytest.raises(ValueError, match="VERICACHE_VERIFIER_TOKEN"):
        RemotePrefixCache(engine, RemoteCacheConfig(url=env.store, verifier=env.v.url))
    (tmp_path / "token").write_text(TOKEN + "\n")  # a mounted Secret file
    monkeypatch.setenv("VERICACHE_VERIFIER_TOKEN_FILE", str(tmp_path / "token"))
    res = ask(engine, env)
    assert (res.path, res.tokens) == ("verified", env.ref), res.error
    assert "VERICACHE_VERIFIER_TOKEN" in proc_env()  # the processes get it by environment, never argv
    assert TOKEN not in " ".join(env.v.argv)
