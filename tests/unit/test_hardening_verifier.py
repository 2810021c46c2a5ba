"""Issue 28, cases 2, 5, 7 and 8: the verifier's socket, attacked as the issue did, against an in-process
VerifierServer (tiny model, memory store) and a fake verifier process.

2: unauthenticated connections made it buffer up to 4 x max_call_bytes each, with no cap on connections.
5: calls travelled in clear, the token in every frame.
7: every refused call was a WARNING line, no rate limit; request ids were logged unescaped.
8: a drafter whose verifier died waited out the call's whole deadline.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import struct
import threading
import time
import uuid

import pytest
import torch
from verifier_procs import (
    CLIENT_PUBLIC,
    CLIENT_SECRET,
    STRANGER_PUBLIC,
    STRANGER_SECRET,
    TOKEN,
    client_env,
    dealer,
    fake_verifier,
    server_env,
)

from vericache_connector.remote import RemoteCacheConfig, StoreClient, auth, rpc
from vericache_connector.remote.verifier import VerifierConfig, VerifierCore
from vericache_connector.remote.verifier_server import ServerSettings, VerifierServer

from stores import SilentServer
from tiny_model import tiny_engine

pytest.importorskip("zmq", reason="pyzmq is not installed (it comes with vLLM)")
CHUNK = 64


@pytest.fixture(scope="module")
def eng():
    return tiny_engine()


class Served:
    """A VerifierServer on its own thread (stop() ends it)."""

    def __init__(self, eng, keys, store_url: str | None = None, **settings):
        url = store_url or f"local://v{uuid.uuid4().hex[:8]}"
        self.store = StoreClient(
            RemoteCacheConfig(url=url, chunk_size=CHUNK, timeout_s=30.0), eng.model_name, torch.float32
        )
        core = VerifierCore(eng.model, eng.model_name, VerifierConfig(chunk_size=CHUNK))
        st = ServerSettings(**{"port": 0, **settings})
        self.server = VerifierServer(core, self.store, TOKEN.encode(), st, keys=keys)
        self.url = f"tcp://127.0.0.1:{self.server.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.server.stop.set()
        self.thread.join(10)
        self.store.close()
        assert not self.thread.is_alive()


@pytest.fixture
def served(eng):
    servers = []

    def start(keys="curve", **settings):
        s = Served(eng, auth.server_keys(server_env()) if keys == "curve" else keys, **settings)
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.stop()


def client(url, secret=CLIENT_SECRET, **kw) -> rpc.ZmqVerifier:
    env = {**client_env(), "VERICACHE_VERIFIER_CLIENT_SECRET_KEY": secret.decode()}
    return rpc.ZmqVerifier(url, TOKEN.encode(), keys=auth.client_keys(env), **kw)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def greeting(mechanism: bytes = b"CURVE") -> bytes:
    """A ZMTP 3.0 greeting, as a client sends it."""
    return b"\xff" + b"\0" * 8 + b"\x7f\x03\x00" + mechanism.ljust(20, b"\0") + b"\x00" + b"\0" * 31


def stalled(port: int, claim: int, send: int) -> socket.socket:
    """A connection that greets, announces a handshake frame of `claim` bytes, sends `send` of them, stalls."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        s.sendall(greeting() + b"\x06" + struct.pack(">Q", claim) + b"\x05HELLO" + b"\0" * max(0, send - 6))
    except OSError:
        pass  # already dropped
    return s


def closed(s: socket.socket, within_s: float) -> bool:
    s.settimeout(within_s)
    try:
        while True:
            if s.recv(65536) == b"":
                return True
    except (socket.timeout, TimeoutError):
        return False
    except OSError:
        return True


# ---- 5: CURVE; only the drafters' keys get a call through -------------------------------------------------
def test_only_admitted_keys_get_a_call_through(served):
    srv = served()
    ok = client(srv.url)
    stranger = client(srv.url, STRANGER_SECRET)
    try:
        assert isinstance(ok.call(rpc.Stats()), rpc.Usage)
        t0 = time.monotonic()
        with pytest.raises(rpc.VerifierUnavailable, match="refused this drafter's CURVE key"):
            stranger.call(rpc.Stats())
        assert time.monotonic() - t0 < 2
    finally:
        ok.close()
        stranger.close()
    import zmq

    raw = zmq.Context.instance().socket(zmq.DEALER)  # no CURVE at all: its handshake fails, nothing is read
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(srv.url)
    try:
        raw.send_multipart(rpc.call_frames(TOKEN.encode(), rpc.Stats()))
        assert not raw.poll(1500)  # no answer: not even a Failure, the call was never read
    finally:
        raw.close(0)
    assert srv.server.failures == {} and srv.server.gate.counts["refused"] >= 1


def test_a_missing_key_is_a_clear_error_and_insecure_is_explicit(monkeypatch):
    for name in [*client_env(), *server_env()]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(auth.INSECURE_ENV, raising=False)
    with pytest.raises(ValueError, match="VERICACHE_VERIFIER_CLIENT_SECRET_KEY_FILE and VERICACHE_VERIFIER_PUBLIC_KEY"):
        rpc.ZmqVerifier("tcp://127.0.0.1:9", TOKEN.encode())
    with pytest.raises(ValueError, match="VERICACHE_VERIFIER_SECRET_KEY_FILE"):
        auth.server_keys()
    monkeypatch.setenv("VERICACHE_VERIFIER_PUBLIC_KEY", "not-a-key")
    monkeypatch.setenv("VERICACHE_VERIFIER_CLIENT_SECRET_KEY", CLIENT_SECRET.decode())
    with pytest.raises(ValueError, match="VERICACHE_VERIFIER_PUBLIC_KEY is not a CURVE key") as e:
        auth.client_keys()
    assert CLIENT_SECRET.decode() not in str(e.value) and CLIENT_SECRET.decode() not in repr(
        auth.client_keys(client_env())
    )
    monkeypatch.setenv(auth.INSECURE_ENV, "1")
    with pytest.raises(ValueError, match="both set"):
        auth.client_keys()
    assert auth.client_keys({auth.INSECURE_ENV: "1"}) is None and auth.server_keys({auth.INSECURE_ENV: "1"}) is None


def test_keys_from_mounted_files(tmp_path):
    env = auth.write_keys(str(tmp_path / "keys"))
    server, drafter = auth.server_keys(env), auth.client_keys(env)
    assert drafter.server == server.public and len(server.clients) == 1
    assert all(os.stat(p).st_mode & 0o077 == 0 for p in env.values())


# ---- 2: what a peer without a key can make the verifier hold ----------------------------------------------
def test_unauthenticated_connections_cannot_make_it_buffer(served):
    srv = served(handshake_s=2.0)
    port = srv.server.port
    # a handshake frame announced bigger than a frame: dropped at once, unread (was: up to 32 MiB buffered)
    big = [stalled(port, 30 << 20, 1 << 20) for _ in range(20)]
    assert all(closed(s, 3) for s in big)
    for s in big:
        s.close()
    before = rss_mb()
    conns = [stalled(port, rpc.FRAME_BYTES, rpc.FRAME_BYTES - 1000) for _ in range(200)]  # just under the cap
    time.sleep(0.5)
    grew = rss_mb() - before
    ok = client(srv.url)
    try:
        assert isinstance(ok.call(rpc.Stats()), rpc.Usage)  # a drafter is still served meanwhile
    finally:
        ok.close()
    assert grew < 40, f"200 stalled unauthenticated connections cost {grew:.1f} MB"  # ~19 MB measured
    assert all(closed(s, 5) for s in conns)  # the handshake deadline (2 s) ends them
    for s in conns:
        s.close()


def test_connections_without_a_handshake_are_capped_per_address(served):
    srv = served(max_pending_per_address=8, handshake_s=30.0)
    conns = [stalled(srv.server.port, 100, 50) for _ in range(30)]
    t0 = time.monotonic()
    cut = sum(closed(s, max(0.05, 3 - (time.monotonic() - t0))) for s in conns)
    assert cut >= 20 and srv.server.gate.counts["evicted"] >= 20  # long before the 30 s handshake deadline
    assert len(srv.server.gate.pending) <= 8
    for s in conns:
        s.close()
    ok = client(srv.url)
    try:
        assert isinstance(ok.call(rpc.Stats()), rpc.Usage)
    finally:
        ok.close()


def test_idle_sockets_without_a_key_do_not_keep_a_keyed_drafter_out(served):
    """100 idle raw TCP connections against a cap of 50 (issue 42, item 5): they use the handshake budget,
    never the drafters' share, and a drafter with the right key is served at once."""
    srv = served(max_connections=50, handshake_s=30.0)
    idle = [socket.create_connection(("127.0.0.1", srv.server.port), timeout=5) for _ in range(100)]
    try:
        time.sleep(0.3)
        t0 = time.monotonic()
        drafters = [client(srv.url, connect_timeout_s=2.0) for _ in range(3)]
        try:
            assert all(isinstance(d.call(rpc.Stats()), rpc.Usage) for d in drafters)
        finally:
            for d in drafters:
                d.close()
        assert time.monotonic() - t0 < 5 and srv.server.gate.counts["cut"] == 0
    finally:
        for s in idle:
            s.close()


def test_admitted_connections_are_capped(served):
    srv = served(max_connections=2)
    first = [client(srv.url) for _ in range(2)]
    third = None
    try:
        assert all(isinstance(d.call(rpc.Stats()), rpc.Usage) for d in first)
        third = client(srv.url, connect_timeout_s=0.5, timeout_s=2.0)  # connects now: over the cap
        with pytest.raises(rpc.VerifierError):
            third.call(rpc.Stats())
        assert srv.server.gate.counts["cut"] >= 1 and len(srv.server.gate.open) == 2
    finally:
        for d in [*first, third]:
            if d is not None:
                d.close()


def test_a_drafters_waiting_calls_are_capped_in_bytes(served, eng):
    hung = SilentServer()  # the store never answers: every load hangs, the calls wait
    srv = served(
        store_url=f"redis://127.0.0.1:{hung.port}/0", max_call_bytes=8192, max_pending_bytes=8192, metrics_port=0
    )
    prompt = [200] * 2600  # ~5.2 KB a call: the second one is over the drafter's 8 KiB
    sock = dealer(srv.url)
    try:
        for i in range(3):
            c = rpc.Verify(eng.model_name, f"r{i}", 0, prompt, 2560, [], [], 8)
            sock.send_multipart(rpc.call_frames(TOKEN.encode(), c))
        assert sock.poll(5000)
        answer = rpc.decode_answer(sock.recv_multipart()[0])
        assert isinstance(answer, rpc.Failure) and answer.code == "busy" and "8192" in answer.message, answer
        assert answer.request in ("r1", "r2")
        deadline = time.monotonic() + 10  # r0 waits for its KV (the queue-length gauge), the others were refused
        while (got := scrape(srv))["vericache_verifier_loading_requests", ()] < 1:  # its load is started next
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert got["vericache_verifier_queued_calls", ()] == 1
        assert got["vericache_verifier_fallbacks_total", (("code", "busy"),)] >= 1
    finally:
        sock.close(0)
        hung.close()


# ---- metrics (issue 40): /metrics over HTTP on --metrics-port -------------------------------------------
def scrape(srv, prefix: str = "vericache_verifier_") -> dict[tuple[str, tuple], float]:
    """GET the verifier's /metrics: {(sample name, labels): value} of its series named prefix*."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{srv.server.metrics_server.port}/metrics", timeout=10) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    return {
        (x.name, tuple(sorted(x.labels.items()))): x.value
        for f in text_string_to_metric_families(text)
        for x in f.samples
        if x.name.startswith(prefix)
    }


def test_metrics_count_requests_verify_calls_accepted_drafts_and_refusals(served, eng):
    """Issue 40: the verifier's /metrics after a request verified in two calls (the second with drafts, some
    accepted), a drafter key it does not admit, and a call with a wrong token."""
    from vericache_connector.engine import DecodeConfig

    srv = served(metrics_port=0)
    prompt = torch.randint(0, 256, (80,), generator=torch.Generator().manual_seed(5)).tolist()
    pre = eng.prefill(prompt[:CHUNK])
    layers = [{"k": k, "v": v} for k, v in zip(pre.prefix.keys, pre.prefix.values)]
    srv.store.call(srv.store.store.put_prefix(prompt[:CHUNK], layers))
    ref = eng.generate_full([eng.prefill(prompt)], DecodeConfig(max_new_tokens=6, stop_at_eos=False))[0]
    ok, stranger = client(srv.url), client(srv.url, STRANGER_SECRET)
    try:
        first = ok.call(rpc.Verify(eng.model_name, "r", 0, prompt, CHUNK, [], [], 8))
        assert first.token == ref[0]
        wrong = (ref[4] + 1) % eng.model.cfg.vocab_size
        second = ok.call(rpc.Verify(eng.model_name, "r", 1, prompt, CHUNK, ref[:1], ref[1:4] + [wrong], 8))
        assert second.accepted == 3
        with pytest.raises(rpc.VerifierUnavailable):
            stranger.call(rpc.Stats())
    finally:
        ok.close()
        stranger.close()
    sock = dealer(srv.url)
    try:
        sock.send_multipart(rpc.call_frames(b"not-the-token-0123456789", rpc.Stats()))
        assert sock.poll(5000) and rpc.decode_answer(sock.recv_multipart()[0]).code == "auth"
    finally:
        sock.close(0)
    got = scrape(srv)
    want = {
        ("vericache_verifier_requests_total", ()): 1,
        ("vericache_verifier_verify_calls_total", ()): 2,
        ("vericache_verifier_accepted_drafts_count", ()): 2,
        ("vericache_verifier_accepted_drafts_sum", ()): 3,
        ("vericache_verifier_accepted_drafts_bucket", (("le", "2.0"),)): 1,  # the first call had no drafts
        ("vericache_verifier_drafts_total", ()): 4,
        ("vericache_verifier_load_seconds_count", ()): 1,
        ("vericache_verifier_queued_calls", ()): 0,
        ("vericache_verifier_resident_requests", ()): 1,
        ("vericache_verifier_auth_failures_total", (("kind", "token"),)): 1,
        ("vericache_verifier_fallbacks_total", (("code", "auth"),)): 1,
        ("vericache_verifier_fallbacks_total", (("code", "store"),)): 0,
    }
    assert {k: got.get(k) for k in want} == want
    assert got["vericache_verifier_auth_failures_total", (("kind", "key"),)] >= 1  # the stranger's handshake
    assert got["vericache_verifier_connections", (("state", "admitted"),)] >= 0
    assert got["vericache_verifier_resident_bytes", ()] > 0 and got["vericache_verifier_forwards_total", ()] == 2
    assert scrape(srv, "process_")["process_resident_memory_bytes", ()] > 0  # the process's own, too


def test_drafter_metrics_beside_the_verifiers(served, eng, monkeypatch):
    """Issue 40: a drafter (its aiohttp app on 127.0.0.1) with this verifier: a miss, then a hit verified next to
    the store; the drafter's GET /metrics and the verifier's count the same verify calls and accepted drafts."""
    from aiohttp.test_utils import TestClient, TestServer
    from prometheus_client.parser import text_string_to_metric_families

    from vericache_connector.remote.drafter_server import DrafterService, make_app

    for k, v in client_env().items():
        monkeypatch.setenv(k, v)
    srv = served(metrics_port=0)
    cfg = RemoteCacheConfig(url=srv.store.cfg.url, chunk_size=CHUNK, compressor="int8", verifier=srv.url)
    service = DrafterService(tiny_engine(), cfg)  # its own copy of the model (the verifier's runs on its thread)
    prompt = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(9)).tolist()
    body = {"prompt_ids": prompt, "max_new_tokens": 12, "draft_k": 4, "stop_at_eos": False}

    async def run():
        async with TestClient(TestServer(make_app(service), host="127.0.0.1")) as c:
            paths = []
            for b in (body, body, {"prompt_ids": "x"}):
                r = await c.post("/v1/generate", json=b)
                paths.append((await r.json()).get("path", r.status))
            r = await c.get("/metrics")
            return paths, r.headers["Content-Type"], await r.text()

    try:
        paths, ctype, text = asyncio.run(asyncio.wait_for(run(), 300))
    finally:
        service.close()
    assert paths == ["miss", "verified", 400] and ctype.startswith("text/plain")
    got = {
        (x.name, tuple(sorted(x.labels.items()))): x.value
        for f in text_string_to_metric_families(text)
        for x in f.samples
        if x.name.startswith("vericache_drafter_")
    }
    verifier = scrape(srv)
    calls = got["vericache_drafter_verify_calls_total", ()]
    assert calls >= 1 and calls == got["vericache_drafter_accepted_drafts_count", ()]
    assert calls == verifier["vericache_verifier_verify_calls_total", ()]  # one drafter, one verifier: the same calls
    assert got["vericache_drafter_accepted_drafts_sum", ()] == verifier["vericache_verifier_accepted_drafts_sum", ()]
    assert got["vericache_drafter_requests_total", (("mode", "vericache"), ("path", "verified"))] == 1
    assert got["vericache_drafter_requests_total", (("mode", "vericache"), ("path", "miss"))] == 1
    assert got["vericache_drafter_request_errors_total", (("status", "400"),)] == 1
    assert got["vericache_drafter_bytes_read_total", (("copy", "compressed"),)] > 0
    assert got["vericache_drafter_bytes_read_total", (("copy", "full"),)] == 0  # verified: the full copy stays put
    assert got["vericache_drafter_queued_requests", ()] == got["vericache_drafter_requests_in_flight", ()] == 0
    assert not [k for k in got if k[0] == "vericache_drafter_fallbacks_total"]


def test_metrics_are_off_unless_a_port_is_given(served):
    assert served().server.metrics_server is None


# ---- 7: bounded logs, escaped request ids --------------------------------------------------------------
def test_refusals_are_logged_at_a_bounded_rate_and_request_ids_escaped(served, caplog, eng):
    window = 2.5
    srv = served(log_window_s=window, max_pending_per_address=64)  # 30 strangers from one address, in turn
    t0 = time.monotonic()
    caplog.set_level(logging.WARNING, logger="vericache.verifier")
    strangers = [client(srv.url, STRANGER_SECRET, connect_timeout_s=0.3) for _ in range(30)]
    for s in strangers:
        with pytest.raises(rpc.VerifierUnavailable):
            s.call(rpc.Stats())
        s.close()
    sock = dealer(srv.url)
    try:
        evil = "r1\n2026-01-01 00:00:00 INFO vericache: FORGED"
        for i in range(40):  # an admitted drafter, wrong token / wrong model (with a forged line in its id)
            c = rpc.Verify("other.model", evil, i, [1] * 100, 64, [], [], 8)
            sock.send_multipart(
                rpc.call_frames(b"wrong-token-0123456789", c) if i % 2 else rpc.call_frames(TOKEN.encode(), c)
            )
            assert sock.poll(5000)
            sock.recv_multipart()
    finally:
        sock.close(0)
    assert time.monotonic() - t0 < window, "the flood took longer than one window: the bound below is off"
    time.sleep(window + 0.6)  # every kind's window passes: the summaries come
    lines = [r.getMessage() for r in caplog.records if r.name == "vericache.verifier"]
    assert srv.server.gate.counts["refused"] >= 30 and sum(srv.server.failures.values()) == 40
    assert len(lines) <= 3 * (3 + 1), lines  # 3 kinds (handshakes, token, model) x (3 lines + 1 summary), not 70
    assert all(any(f"more {kind}" in line for line in lines) for kind in ("refused handshakes", "refused calls (auth)"))
    assert not any("\n" in line for line in lines) and any("r1\\n2026" in line for line in lines), lines


# ---- 8: a dead verifier is noticed within seconds ----------------------------------------------------------
def verify_call(eng, request: str) -> rpc.Verify:
    return rpc.Verify(eng.model_name, request, 0, [1] * 100, 64, [], [], 8)


def test_a_dead_verifier_is_noticed_within_seconds(eng, tmp_path):
    fake = fake_verifier("silent", str(tmp_path / "silent.log"))  # reads calls, never answers
    c = client(fake.url, timeout_s=30.0)
    try:
        c.send(verify_call(eng, "dies"))
        assert c.poll(0.5) is None  # in flight, unanswered
        os.killpg(fake.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(rpc.VerifierUnavailable, match="connection ended"):
            c.poll(3600)
        assert time.monotonic() - t0 < 5  # was: the call's whole 30 s deadline
    finally:
        c.close()
        fake.kill()


class FreezingProxy:
    """Relays one TCP connection until freeze(); then holds it open and relays nothing (a host gone silent)."""

    def __init__(self, port: int):
        self.target, self.frozen = port, threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        try:
            a, _ = self.sock.accept()
        except OSError:
            return
        b = socket.create_connection(("127.0.0.1", self.target))
        self.held += [a, b]
        for src, dst in ((a, b), (b, a)):
            threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    def _pipe(self, src, dst):
        try:
            while data := src.recv(65536):
                if self.frozen.is_set():
                    continue  # swallowed: no FIN, no RST, nothing
                dst.sendall(data)
        except OSError:
            pass

    def close(self):
        for s in [self.sock, *self.held]:
            s.close()


def test_a_silent_verifier_host_is_noticed_by_heartbeats(eng, tmp_path):
    fake = fake_verifier("silent", str(tmp_path / "silent.log"))
    proxy = FreezingProxy(fake.port)
    c = client(f"tcp://127.0.0.1:{proxy.port}", timeout_s=30.0, heartbeat_s=0.5)
    try:
        c.send(verify_call(eng, "silent-host"))
        assert c.poll(0.5) is None
        proxy.frozen.set()
        t0 = time.monotonic()
        with pytest.raises(rpc.VerifierUnavailable, match="connection ended"):
            c.poll(3600)
        assert time.monotonic() - t0 < 5  # 3 missed heartbeats of 0.5 s
    finally:
        c.close()
        proxy.close()
        fake.stop()


def test_a_restart_between_requests_does_not_fail_the_next_call(served):
    """Connection events from before a call do not fail it: the verifier went away and came back on
    the same port between two requests; the client reconnects and the next call is answered."""
    srv = served()
    c = client(srv.url)
    try:
        assert isinstance(c.call(rpc.Stats()), rpc.Usage)
        port = srv.server.port
        srv.stop()
        again = served(port=port)
        assert again.server.port == port
        deadline = time.monotonic() + 10
        while True:
            try:
                assert isinstance(c.call(rpc.Stats()), rpc.Usage)
                break
            except rpc.VerifierUnavailable:
                assert time.monotonic() < deadline
    finally:
        c.close()


def test_clients_repr_and_key_reprs_hide_secrets():
    keys = auth.client_keys(client_env())
    assert CLIENT_SECRET.decode() not in repr(keys) and CLIENT_PUBLIC.decode() in repr(keys)
    server = auth.server_keys(server_env())
    assert server.secret.decode() not in repr(server)
    assert STRANGER_PUBLIC not in {bytes(k) for k in server.clients}
