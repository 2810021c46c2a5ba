"""The drafters + verifier protocol without processes: messages and their bounds, the token, the verifier
core on the tiny random model (batched verdicts == one-by-one verdicts, LRU and TTL, retried calls) and
the drafter's pipeline against it (output == full-KV greedy whatever the answer latency), and the ZMQ
client against an in-thread ROUTER (stale answers, refusals, timeouts)."""

from __future__ import annotations

import threading

import msgspec
import pytest
import torch

from vericache_connector.compressors import get_compressor
from vericache_connector.engine import DecodeConfig
from vericache_connector.remote import RemoteCacheConfig, rpc
from vericache_connector.remote.drafter import VerifiedDecode
from vericache_connector.remote.verifier import CallError, VerifierConfig, VerifierCore

from tiny_model import tiny_engine

pytest.importorskip("zmq", reason="pyzmq is not installed (it comes with vLLM)")
STORED, CHUNK = 128, 64
SECRET = "a-verifier-token-0123456789"


@pytest.fixture(autouse=True)
def _no_curve(monkeypatch):
    """The protocol and the client against an in-thread ROUTER without CURVE keys (a test setup: calls in
    clear); CURVE itself: tests/unit/test_hardening_verifier.py (a verifier dying mid-call, end to end: tests/integration/stores/test_verifier_dies_midcall.py)."""
    monkeypatch.setenv("VERICACHE_VERIFIER_INSECURE", "1")
    for name in ("SECRET_KEY", "CLIENT_KEYS", "CLIENT_SECRET_KEY", "PUBLIC_KEY"):
        monkeypatch.delenv(f"VERICACHE_VERIFIER_{name}", raising=False)
        monkeypatch.delenv(f"VERICACHE_VERIFIER_{name}_FILE", raising=False)


@pytest.fixture(scope="module")
def eng():
    return tiny_engine()


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 256, (160,), generator=torch.Generator().manual_seed(3)).tolist()


def call(eng, prompt, request="r", seq=0, emitted=(), drafts=(), **kw) -> rpc.Verify:
    return rpc.Verify(eng.model_name, request, seq, prompt, STORED, list(emitted), list(drafts), 40, **kw)


def load(core: VerifierCore, eng, c: rpc.Verify):
    """The call checked and its resident in (the stored prefix's exact KV, as the server loads it)."""
    core.check(c)
    r = core.resident(c)
    if r is None:
        r = core.admit(c, set())
        pre = eng.prefill(c.prompt[: c.stored])
        r.cache.load_row(0, pre.prefix.keys, pre.prefix.values)
        r.ready = True
    return r


class Loopback:
    """The client interface over a VerifierCore in this process; answers show up after `delay` polls."""

    def __init__(self, core: VerifierCore, eng, delay: int = 0, cheap_calls: bool = False):
        self.core, self.eng, self.delay, self.answer, self.polls = core, eng, delay, None, 0
        self.cheap_calls, self.sizes = cheap_calls, []

    def send(self, c: rpc.Verify, timeout_s=None) -> None:
        self.sizes.append(len(c.drafts))
        self.answer, self.polls = self.core.verify([(c, load(self.core, self.eng, c))])[0], 0

    def poll(self, wait_s: float = 0.0):
        self.polls += 1
        if wait_s == 0 and self.polls <= self.delay:
            return None
        answer, self.answer = self.answer, None
        return answer

    def release(self, request: str) -> None:
        self.core.drop(request)


# ---- messages, token, URLs -------------------------------------------------------------------------
def test_messages_round_trip_and_bad_bytes_are_clear_errors(eng, prompt):
    c = call(eng, prompt, drafts=[1, 2])
    assert rpc.decode_call(rpc.encode(c)) == c
    v = rpc.Verdict("r", 3, 1, 7, batch=2)
    assert rpc.decode_answer(rpc.encode(v)) == v
    for junk, words in (
        (b"\xc1", "malformed"),
        (rpc.encode(v), "Expected `object`|Invalid value"),  # an answer is not a call
        (msgspec.msgpack.encode({"type": "verify", "model": "m"}), "missing required field"),
        (msgspec.msgpack.encode({**msgspec.to_builtins(c), "prompt": "not ids"}), "Expected `array`"),
    ):
        with pytest.raises(ValueError, match=words):
            rpc.decode_call(junk)
    with pytest.raises(ValueError, match="over the"):
        rpc.decode_answer(b"\x00" * (rpc.MAX_ANSWER_BYTES + 1))


def test_token_from_a_file_or_the_environment_never_shown(tmp_path, monkeypatch):
    monkeypatch.delenv("VERICACHE_VERIFIER_TOKEN", raising=False)
    monkeypatch.delenv("VERICACHE_VERIFIER_TOKEN_FILE", raising=False)
    with pytest.raises(ValueError, match="VERICACHE_VERIFIER_TOKEN_FILE"):
        rpc.verifier_token()
    monkeypatch.setenv("VERICACHE_VERIFIER_TOKEN", SECRET)
    assert rpc.verifier_token() == SECRET.encode()
    (tmp_path / "t").write_text(SECRET + "\n")
    monkeypatch.setenv("VERICACHE_VERIFIER_TOKEN_FILE", str(tmp_path / "t"))
    with pytest.raises(ValueError, match="not both"):
        rpc.verifier_token()
    monkeypatch.delenv("VERICACHE_VERIFIER_TOKEN")
    assert rpc.verifier_token() == SECRET.encode()
    monkeypatch.setenv("VERICACHE_VERIFIER_TOKEN", "short")
    monkeypatch.delenv("VERICACHE_VERIFIER_TOKEN_FILE")
    with pytest.raises(ValueError, match="at least 16 bytes") as e:
        rpc.verifier_token()
    assert "short" not in str(e.value)
    client = rpc.ZmqVerifier("tcp://127.0.0.1:9", SECRET.encode())
    assert SECRET not in repr(client) and SECRET not in str(vars(client).get("url"))
    client.close()


def test_our_verifier_and_vllm_are_both_verifier_clients(monkeypatch):
    """The drafter's loop talks to either through the VerifierClient protocol; cheap_calls tells them apart."""
    from vericache_connector.remote.client import VerifierClient, make_verifier

    monkeypatch.setenv("VERICACHE_VERIFIER_TOKEN", SECRET)
    for url, cheap in (("tcp://127.0.0.1:9", True), ("http://127.0.0.1:9", False)):
        client = make_verifier(url, None, 1.0)
        assert isinstance(client, VerifierClient) and client.cheap_calls is cheap
        client.close()


@pytest.mark.parametrize("url", ["tcp://host", "http://h:1", "tcp://:80", "tcp://h:1/x", "tcp://h:99999"])
def test_bad_verifier_urls(url):
    with pytest.raises(ValueError, match="verifier URL"):
        rpc.zmq_endpoint(url)


def test_config_checks_the_verifier_url_and_hides_its_password():
    with pytest.raises(ValueError, match="verifier URL"):
        RemoteCacheConfig(verifier="udp://h:1")
    with pytest.raises(ValueError, match="verifier_timeout_s"):
        RemoteCacheConfig(verifier="tcp://h:1", verifier_timeout_s=0)
    with pytest.raises(ValueError, match="verifier_load_timeout_s"):
        RemoteCacheConfig(verifier="tcp://h:1", verifier_load_timeout_s=-1.0)
    cfg = RemoteCacheConfig(verifier="http://user:pw-s3cret@h:8000")
    assert "pw-s3cret" not in repr(cfg) and "verifier='http://***@h:8000'" in repr(cfg)


# ---- the verifier core -----------------------------------------------------------------------------
def test_hidden_states_match_the_models_forward(eng, prompt):
    m = eng.model
    a, b = m.new_cache(1, 200), m.new_cache(1, 200)
    ids, pos = torch.tensor([prompt[:50]]), torch.arange(50)[None]
    want, _ = m(ids, pos, a)
    h, _ = m.hidden_states(ids, pos, b)
    assert torch.equal(m.logits(h), want) and torch.equal(a.lengths, b.lengths)


def test_batched_verdicts_equal_one_by_one(eng, prompt):
    ref = eng.generate_full([eng.prefill(prompt)], DecodeConfig(max_new_tokens=16, stop_at_eos=False))[0]
    calls = [
        call(eng, prompt, "a", 0, ref[:5], ref[5:9]),
        call(eng, prompt, "b", 0, ref[:2], ref[2:3] + [7, 7]),
        call(eng, prompt, "c", 0, [], []),
        call(eng, prompt, "d", 0, ref[:8], [ref[8], (ref[9] + 1) % 256]),
    ]
    alone = VerifierCore(eng.model, eng.model_name, VerifierConfig(chunk_size=CHUNK))
    together = VerifierCore(eng.model, eng.model_name, VerifierConfig(chunk_size=CHUNK))
    one = [(v.accepted, v.token) for c in calls for v in _verify(alone, eng, [c])]
    batched = [(v.accepted, v.token) for v in _verify(together, eng, calls)]
    assert one == batched == [(4, ref[9]), (1, ref[3]), (0, ref[0]), (1, ref[9])]
    assert together.counts["max_batch"] == 4 and together.counts["forwards"] == 1
    # the next round of every request, again batched: the residents kept exactly what was accepted
    nxt = [call(eng, prompt, n, 1, ref[:e], ref[e : e + 3]) for n, e in (("a", 10), ("b", 4), ("c", 1), ("d", 10))]
    assert [(v.accepted, v.token) for v in together.verify([(c, together.resident(c)) for c in nxt])] == [
        (3, ref[13]),
        (3, ref[7]),
        (3, ref[4]),
        (3, ref[13]),
    ]


def _verify(core, eng, calls):
    return core.verify([(c, load(core, eng, c)) for c in calls])


def test_a_retried_or_stale_call_gets_the_same_answer(eng, prompt):
    ref = eng.generate_full([eng.prefill(prompt)], DecodeConfig(max_new_tokens=12, stop_at_eos=False))[0]
    core = VerifierCore(eng.model, eng.model_name, VerifierConfig(chunk_size=CHUNK))
    lb = Loopback(core, eng)
    c1 = call(eng, prompt, "r", 1, ref[:3], ref[3:7])
    lb.send(c1)
    first = lb.poll()
    lb.send(call(eng, prompt, "r", 2, ref[:8], ref[8:10]))
    lb.poll()
    lb.send(c1)  # the same call again (its answer was lost): the resident rolls back
    assert lb.poll() == first and (first.accepted, first.token) == (4, ref[7])


def test_memory_budget_evicts_the_least_recently_used(eng, prompt):
    per_request = (len(prompt) + 40 + rpc.MAX_DRAFTS + 2) * VerifierCore(eng.model, "x").bytes_per_token
    core = VerifierCore(eng.model, eng.model_name, VerifierConfig(chunk_size=CHUNK, memory_bytes=2 * per_request))
    lb = Loopback(core, eng)
    for name in ("a", "b"):
        lb.send(call(eng, prompt, name))
    core.resident(call(eng, prompt, "a"))  # a is used again: b is now the oldest
    lb.send(call(eng, prompt, "c"))
    assert list(core.residents) == ["a", "c"] and core.counts["evicted"] == 1
    with pytest.raises(CallError, match="budget is taken"):
        core.admit(call(eng, prompt, "d"), pinned={"a", "c"})
    assert core.expire(now=1e18, pinned={"a"}) == ["c"] and list(core.residents) == ["a"]


@pytest.mark.parametrize(
    "kw,code",
    [
        ({"model": "other.123"}, "model"),
        ({"request": ""}, "malformed"),
        ({"stored": 100}, "malformed"),
        ({"stored": 160}, "malformed"),
        ({"drafts": [256]}, "malformed"),
        ({"drafts": [1] * (rpc.MAX_DRAFTS + 1)}, "too_large"),
        ({"emitted": [1] * 5000}, "too_large"),
        ({"max_new": 0}, "malformed"),
        ({"temperature": float("nan")}, "malformed"),
        ({"temperature": 1.0, "drafts": [1], "q": b"\x00" * 8}, "malformed"),
    ],
)
def test_calls_that_do_not_fit_are_refused(eng, prompt, kw, code):
    core = VerifierCore(eng.model, eng.model_name, VerifierConfig(chunk_size=CHUNK))
    with pytest.raises(CallError) as e:
        core.check(msgspec.structs.replace(call(eng, prompt), **kw))
    assert e.value.code == code


# ---- the drafter's pipeline against the core -------------------------------------------------------
def pipeline(eng, prompt, cfg, client, compressor="kivi2"):
    core = client.core
    comp = get_compressor(compressor).compress(eng.prefill(prompt[:STORED]).prefix)
    draft = eng.draft_cache([comp], len(prompt) - STORED + cfg.cache_headroom)
    session = VerifiedDecode(client, eng.model_name, prompt, STORED, cfg, eng.model.cfg)
    session.open()
    out = session.run(eng.draft_model(), draft)
    assert not core.residents  # released at the end
    return out


@pytest.mark.parametrize("delay", [0, 2, 6, 30])
@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("cheap", [False, True], ids=["calls-of-k", "calls-as-ready"])
def test_pipeline_output_is_full_kv_greedy(eng, prompt, delay, k, cheap):
    """Answers that come at once, after a few draft steps, or after many (the drafter drafts ahead up to
    k_max and throws away what a rejection invalidates), calls of draft_k or of what is ready: always the
    full-KV greedy output."""
    cfg = DecodeConfig(max_new_tokens=30, draft_k=k, k_min=1, k_max=16, stop_at_eos=False)
    ref = eng.generate_full([eng.prefill(prompt)], cfg)[0]
    core = VerifierCore(eng.model, eng.model_name, VerifierConfig(chunk_size=CHUNK))
    out = pipeline(eng, prompt, cfg, Loopback(core, eng, delay, cheap))
    assert out.tokens == ref
    assert sum(out.stats.accepted[0]) + out.calls == len(ref)  # every token: an accepted draft or a verdict's
    assert out.stats.draft_lengths[0] == 0 and max(out.stats.draft_lengths) <= 16


def test_cheap_calls_go_out_as_soon_as_the_answer_is_in(eng, prompt):
    """Our verifier (cheap_calls): a call goes out when the previous answer is in, with the k_min.. drafts
    ready, so fewer drafts are thrown away than with calls of draft_k; vLLM's API: calls of draft_k."""
    cfg = DecodeConfig(max_new_tokens=30, draft_k=8, k_min=2, k_max=16, stop_at_eos=False)
    ref = eng.generate_full([eng.prefill(prompt)], cfg)[0]
    core = VerifierCore(eng.model, eng.model_name, VerifierConfig(chunk_size=CHUNK))
    runs = {}
    for cheap in (False, True):
        client = Loopback(core, eng, 2, cheap)
        runs[cheap] = out = pipeline(eng, prompt, cfg, client, "streamingllm-8x")  # rejects often here
        assert out.tokens == ref and client.sizes == out.stats.draft_lengths
    sized = runs[False].stats.draft_lengths[1:-2]  # the opening call has none, the last ones what is left
    assert len(sized) >= 3 and all(x == 8 for x in sized), runs[False].stats.draft_lengths
    ready = runs[True].stats.draft_lengths[1:]
    assert ready and max(ready) < 8 and all(x >= 1 for x in ready[:-1]), ready  # the last: what is left
    assert runs[True].drafted < runs[False].drafted, (runs[True].drafted, runs[False].drafted)


def test_pipeline_stops_at_eos_and_the_budget(eng, prompt):
    cfg = DecodeConfig(max_new_tokens=30, draft_k=4, stop_at_eos=False)
    ref = eng.generate_full([eng.prefill(prompt)], cfg)[0]
    eos = ref[7]
    eng2 = tiny_engine(eos_token_ids=(eos,))  # the same weights, with ref[7] as EOS
    cfg = DecodeConfig(max_new_tokens=30, draft_k=4, stop_at_eos=True)
    core = VerifierCore(eng2.model, eng2.model_name, VerifierConfig(chunk_size=CHUNK))
    for cheap in (False, True):
        out = pipeline(eng2, prompt, cfg, Loopback(core, eng2, 3, cheap))
        assert out.tokens == ref[: ref.index(eos) + 1]


# ---- the ZMQ client --------------------------------------------------------------------------------
class Router:
    """An in-thread ROUTER that answers each call with the answers `script` gives for it. Its socket is
    used and closed by its own thread only (a ZMQ socket is not thread-safe: closing it from the test's
    thread while this one waits in recv aborts the interpreter)."""

    def __init__(self, script):
        import zmq

        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.script, self.seen, self.stop = script, [], threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        try:
            while not self.stop.is_set():
                if not self.sock.poll(20):
                    continue
                peer, token, body = self.sock.recv_multipart()
                self.seen.append(token)
                for answer in self.script(rpc.decode_call(body)):
                    self.sock.send_multipart([peer, answer])
        finally:
            self.sock.close(0)

    def close(self):
        self.stop.set()
        self.thread.join(10)
        assert not self.thread.is_alive()


def test_client_drops_stale_answers_and_reports_refusals_and_timeouts(eng, prompt):
    def script(c):
        if c.seq == 0:
            yield rpc.encode(rpc.Verdict(c.request, 99, 0, 1))  # an answer to an older call: dropped
            yield rpc.encode(rpc.Verdict(c.request, c.seq, 0, 5))
        elif c.seq == 1:
            yield rpc.encode(rpc.Failure(c.request, c.seq, "store", "full KV not loaded"))
        elif c.seq == 2:
            yield rpc.encode(rpc.Failure("", -1, "too_large", "call of 9 bytes exceeds the limit"))
        # seq 3: no answer at all

    router = Router(script)
    client = rpc.ZmqVerifier(f"tcp://127.0.0.1:{router.port}", SECRET.encode(), timeout_s=1.0)
    try:
        assert client.call(call(eng, prompt, seq=0)) == rpc.Verdict("r", 0, 0, 5)
        for seq, words in ((1, r"\(store\): full KV not loaded"), (2, r"\(too_large\)")):
            with pytest.raises(rpc.VerifierRefused, match=words):
                client.call(call(eng, prompt, seq=seq))
        with pytest.raises(rpc.VerifierUnavailable, match="no answer within 1.0s"):
            client.call(call(eng, prompt, seq=3))
        assert set(router.seen) == {SECRET.encode()}
    finally:
        client.close()
        router.close()
    down = rpc.ZmqVerifier(f"tcp://127.0.0.1:{router.port}", SECRET.encode(), connect_timeout_s=0.2)
    with pytest.raises(rpc.VerifierUnavailable, match="not reachable"):
        down.send(call(eng, prompt))
    down.close()
