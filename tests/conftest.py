"""Shared fixtures for every test directory.

tests/unit           fast: no real model, no servers (make test-fast runs these and the other fast ones)
tests/integration/   model/ (the real SmolLM2-135M), stores/ (redis, S3, NIXL, the remote cache),
                     vllm/ (vLLM's scheduler in-process, and its OpenAI server on 127.0.0.1)
tests/support/       helper modules the tests import by name (put on sys.path here)

The real model and the bundled long prompts are prefilled once per session; the full-KV greedy
reference outputs are computed once and reused by every test.
"""

from __future__ import annotations

import os
import sys
import uuid

import pytest

SUPPORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "support")
if SUPPORT not in sys.path:
    sys.path.insert(0, SUPPORT)

from run_shared import shared  # noqa: E402

from stores import RedisProcess, has_module, need  # noqa: E402

NEW_TOKENS = 64


# ---------------------------------------------------------------- parallel workers
def pytest_configure(config):
    """Under pytest-xdist (make test: -n 2) each worker gets its share of the cores for torch."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


# ---------------------------------------------------------------- the real model
@pytest.fixture(scope="session")
def engine():
    import torch

    from vericache_connector.engine import VeriCacheEngine

    torch.manual_seed(0)
    return VeriCacheEngine.from_pretrained()


@pytest.fixture(scope="session")
def prefills(engine, tmp_path_factory):
    """The five bundled real prompts (1.9k-5.6k tokens), prefilled on the full KV (once per run)."""
    from vericache_connector.data import load_prompts

    return shared(
        tmp_path_factory, "prefills", lambda: [engine.prefill(engine.encode(text)) for text in load_prompts().values()]
    )


@pytest.fixture(scope="session")
def greedy_cfg():
    from vericache_connector.engine import DecodeConfig

    return DecodeConfig(max_new_tokens=NEW_TOKENS, draft_k=8, stop_at_eos=False)


@pytest.fixture(scope="session")
def reference(engine, prefills, greedy_cfg, tmp_path_factory):
    """Plain full-KV greedy decoding, one token at a time: what VeriCache must reproduce exactly (once per run)."""
    return shared(tmp_path_factory, "reference", lambda: engine.generate_full(prefills, greedy_cfg))


@pytest.fixture(scope="session")
def shortest(prefills, reference):
    """shortest(n): the n shortest prompts' prefills and full-KV greedy references (cheaper runs of a check the
    five prompts already pass elsewhere)."""

    def pick(n: int):
        order = sorted(range(len(prefills)), key=lambda i: prefills[i].num_tokens)[:n]
        return [prefills[i] for i in order], [reference[i] for i in order]

    return pick


@pytest.fixture(scope="session")
def model_dir() -> str:
    """The bundled model's converted checkpoint directory (converted once per machine)."""
    from vericache_connector.model import resolve_model_dir

    return str(resolve_model_dir(None))


# ---------------------------------------------------------------- store URLs
@pytest.fixture
def memory_url():
    from stores import drop_memory_store

    name = f"t{uuid.uuid4().hex[:10]}"
    yield f"local://{name}"
    drop_memory_store(name)


@pytest.fixture
def disk_url(tmp_path):
    return f"local://{tmp_path}/store"


@pytest.fixture
def redis_url():
    url = os.environ.get("VERICACHE_REDIS_URL")
    need(bool(url), os.environ.get("VERICACHE_REDIS_DOWN") or "VERICACHE_REDIS_URL is not set (make test starts one)")
    need(has_module("redis"), "python package 'redis' is not installed")
    return f"{url}?prefix=t{uuid.uuid4().hex[:10]}:"


@pytest.fixture
def s3_url():
    endpoint = os.environ.get("VERICACHE_S3_ENDPOINT")
    need(
        bool(endpoint), os.environ.get("VERICACHE_S3_DOWN") or "VERICACHE_S3_ENDPOINT is not set (make test starts one)"
    )
    need(has_module("boto3"), "python package 'boto3' is not installed")
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")  # moto test dummies
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    return f"s3://vericache-test/t{uuid.uuid4().hex[:10]}?endpoint_url={endpoint}&region=us-east-1"


@pytest.fixture(scope="session")
def nixl_server():
    need(
        has_module("nixl"),
        "python package 'nixl' is not installed (pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1)",
    )
    from storage_backends.nixl_server import NixlStoreServer

    server = NixlStoreServer(capacity_bytes=96 << 20).start()
    yield server
    server.stop()


@pytest.fixture
def nixl_url(nixl_server):
    return f"{nixl_server.url}?prefix=t{uuid.uuid4().hex[:10]}:"


@pytest.fixture(params=["memory", "disk", "redis", "s3", "nixl"])
def any_url(request):
    """Each backend in turn."""
    return request.getfixturevalue(f"{request.param}_url")


@pytest.fixture
def private_redis(tmp_path):
    """A redis-server of this test's own, killable (store-down faults)."""
    r = RedisProcess(str(tmp_path))
    yield r
    r.kill()


@pytest.hookimpl(wrapper=True, tryfirst=True)  # outermost: after pytest's own short test summary
def pytest_terminal_summary(terminalreporter):
    """The run's last line before pytest's counts: how many tests skipped, grouped by reason (a store test skips
    only when its server could not start: make test starts redis-server and a moto S3 server itself)."""
    from collections import Counter

    result = yield
    reasons = Counter(
        str(r.longrepr[2]).removeprefix("Skipped: ")
        for r in terminalreporter.stats.get("skipped", [])
        if isinstance(r.longrepr, tuple) and len(r.longrepr) == 3
    )
    if reasons:
        why = "; ".join(f"{n} x {reason}" for reason, n in reasons.most_common())
        terminalreporter.write_line(f"skipped {sum(reasons.values())} tests: {why}", yellow=True, bold=True)
    return result


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    """Every test that loads the real model is `slow` (make test-fast deselects them), whatever its file says.
    The tests of a module that share a module-scoped fixture (a server, a KVzip run) form one xdist group:
    with --dist loadgroup they run on one worker, so that fixture is set up once."""
    for item in items:
        if "engine" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info is not None else ()
        if any(d[-1].scope == "module" for d in defs if d):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
