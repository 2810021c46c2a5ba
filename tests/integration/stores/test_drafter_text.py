"""The drafter's HTTP API (`vericache drafter`, remote/drafter_server.py) with text: a "prompt" is tokenized with
the model's tokenizer, the answer carries the tokens' "text", its "mode" and "prompt_tokens"; the tokens are
plain full-KV greedy decoding's on a miss, a hit (compressed copy first) and a recompute; bad bodies are 400s
naming the field; `vericache drafter --help` says what each mode runs. The real model, an in-process store,
the app on 127.0.0.1 (no verifier: "vericache" runs as "local")."""

from __future__ import annotations

import asyncio

import pytest

from vericache_connector.data import load_prompt
from vericache_connector.engine.speculative import DecodeConfig
from vericache_connector.remote import RemoteCacheConfig
from vericache_connector.remote.drafter_api import MODES

pytest.importorskip("aiohttp", reason="aiohttp is not installed (it comes with vLLM)")
pytestmark = pytest.mark.slow

NEW = 12


def post_all(service, bodies: list[dict]) -> list[tuple[int, dict]]:
    """POST each body in turn to the drafter app served on 127.0.0.1."""
    from aiohttp.test_utils import TestClient, TestServer

    from vericache_connector.remote.drafter_server import make_app

    async def run():
        async with TestClient(TestServer(make_app(service), host="127.0.0.1")) as client:
            out = []
            for body in bodies:
                r = await client.post("/v1/generate", json=body)
                out.append((r.status, await r.json()))
            return out

    return asyncio.run(asyncio.wait_for(run(), 600))


@pytest.fixture(scope="module")
def service(engine):
    from vericache_connector.remote.drafter_server import DrafterService

    from stores import drop_memory_store

    s = DrafterService(engine, RemoteCacheConfig(url="local://drafter-text", chunk_size=128))
    yield s
    s.close()
    drop_memory_store("drafter-text")


def test_text_in_text_out_identical_to_full_kv(engine, service):
    text = load_prompt("graphlib_py")[:1200]
    ids = engine.encode(text)
    ref = engine.generate_full([engine.prefill(ids)], DecodeConfig(max_new_tokens=NEW, stop_at_eos=False))[0]
    body = {"prompt": text, "max_new_tokens": NEW, "stop_at_eos": False}
    answers = post_all(
        service,
        [body, body, {**body, "mode": "recompute"}, {"prompt_ids": ids, "max_new_tokens": NEW, "stop_at_eos": False}],
    )
    for (status, out), (mode, path) in zip(
        answers, [("vericache", "miss"), ("vericache", "hit"), ("recompute", "recompute"), ("vericache", "hit")]
    ):
        assert status == 200, out
        assert (out["mode"], out["path"], out["prompt_tokens"]) == (mode, path, len(ids)), out
        assert out["tokens"] == ref
        assert out["text"] == engine.tokenizer.decode(ref, skip_special_tokens=True) and out["text"].strip()


@pytest.mark.parametrize(
    "body, words",
    [
        ({"prompt": "x", "prompt_ids": [1, 2]}, "one of the two"),
        ({}, "one of the two"),
        ({"prompt": 5}, "prompt must be non-empty text"),
        ({"prompt": "   "}, "prompt must be non-empty text"),
        ({"prompt_ids": [-1]}, "prompt_ids"),
        ({"prompt": "def f():", "mode": "fast"}, "mode must be one of vericache, local, full-kv, recompute"),
        ({"prompt": "def f():", "mode": ["local"]}, "mode must be one of"),
    ],
)
def test_bad_bodies_are_400s_naming_the_field(service, body, words):
    ((status, out),) = post_all(service, [body])
    assert status == 400 and words in out["error"], out


def test_help_says_what_each_mode_runs():
    from vericache_connector.cli import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices["drafter"]
    text = " ".join(sub.format_help().split())
    assert "POST /v1/generate" in text and "prompt" in text and "prompt_ids" in text and "text" in text
    for mode, what in MODES.items():
        assert f"{mode} {' '.join(what.split())}" in text
