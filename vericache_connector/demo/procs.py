"""Serving nodes as processes on 127.0.0.1, for the shared-prefix demo and benchmarks/disaggregated.py:
`vericache verifier` (next to the store) and `vericache drafter` (a node that serves generate requests),
each started with its own environment and, optionally, pinned to cores of its own.

A process is ready once its log shows its "serving ... on <url>" line (both servers print it after their
warm-up). The verifier's secret never goes on a command line: it is a file in a private folder, named by
the environment (remote/rpc.py reads it).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

# KV bytes per token of a reference model (transfer times over an emulated link are stated for it too)
REF_KV_BYTES_PER_TOKEN = {"llama3-8b": 32 * 8 * 128 * 2 * 2}  # 32 layers, 8 KV heads, head 128, K+V, bf16
# the drafter's "mode" for each way a node can serve a stored prefix (drafter_server.MODES)
MODES = {"verified": "vericache", "local": "local", "full-kv": "full-kv", "recompute": "recompute"}


def usable_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def pinned_cores(role: str, cores: list[int] | None = None) -> list[int]:
    """The verifier on the last core, every other node on the rest: separate machines' compute, emulated."""
    cores = cores or usable_cores()
    if len(cores) < 2:
        raise ValueError(f"pinning needs at least 2 cores, this process may use {len(cores)}")
    return cores[-1:] if role == "verifier" else cores[:-1]


@contextmanager
def affinity(cores: list[int] | None):
    """Pin the calling thread while it forks: the child starts (and every thread it makes stays) on `cores`."""
    if not cores or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def write_verifier_secret(folder: str) -> dict[str, str]:
    """A fresh verifier token and CURVE keys (remote/auth.py) in files only this user reads; returns the
    environment that names them."""
    from ..remote.auth import write_keys

    os.makedirs(folder, mode=0o700, exist_ok=True)
    path = os.path.join(folder, "verifier-token")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(24))
    return {"VERICACHE_VERIFIER_TOKEN_FILE": path, **write_keys(folder)}


def node_env(store_url: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """One torch thread per process (each node is one core's worth of compute); no inherited verifier secret."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERICACHE_VERIFIER_")}
    return {
        **env,
        "VERICACHE_STORE_URL": store_url,
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        **(extra or {}),
    }


class Proc:
    """`python -m vericache_connector <argv>` (or `<program> <argv>`) in its own session, logging to a file.
    It starts at once; wait_ready() until it serves (then .url is set)."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        log_path: str,
        env: dict[str, str],
        cores: list[int] | None = None,
        program: list[str] | None = None,
    ):
        self.name, self.log_path, self.cores = name, log_path, cores
        self.argv = [*(program or [sys.executable, "-m", "vericache_connector"]), *argv]
        self.url: str | None = None
        self._log = open(log_path, "w")
        with affinity(cores):
            self.proc = subprocess.Popen(
                self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def poll_ready(self) -> bool:
        """True once it serves; raises if it exited first."""
        if self.url is None:
            m = re.search(r"serving .* on (\S+)", self.log())
            if m:
                self.url = m.group(1)
            elif self.proc.poll() is not None:
                tail = " | ".join(self.log().strip().splitlines()[-5:])
                raise RuntimeError(f"{self.name} exited with status {self.proc.returncode} before serving: {tail}")
        return self.url is not None

    @property
    def port(self) -> int:
        """The port of .url (once it serves)."""
        return int(self.url.rsplit(":", 1)[1])

    def wait_ready(self, timeout_s: float = 600) -> str:
        deadline = time.monotonic() + timeout_s
        while not self.poll_ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not serve within {timeout_s:g}s (log: {self.log_path})")
            time.sleep(0.2)
        return self.url

    def stop(self) -> None:
        """SIGTERM to its process group, SIGKILL after 20 s."""
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to its process group at once (a crash)."""
        self._signal(signal.SIGKILL)

    def _signal(self, sig) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


def generate(url: str, body: dict, timeout_s: float = 600) -> dict:
    """POST /v1/generate to a drafter; an HTTP error comes back as {"status": code, "error": ...}."""
    req = urllib.request.Request(url + "/v1/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return {"status": e.code, **json.loads(e.read() or b"{}")}


def request(url: str, ids: list[int], way: str, new_tokens: int, draft_k: int, timeout_s: float = 1200) -> dict:
    """One greedy request served `way` (a key of MODES); its answer plus wall_s, the client-measured time."""
    body = {"prompt_ids": ids, "max_new_tokens": new_tokens, "draft_k": draft_k, "stop_at_eos": False}
    t0 = time.perf_counter()
    out = generate(url, {**body, "mode": MODES[way]}, timeout_s)
    out["wall_s"] = time.perf_counter() - t0
    if "tokens" not in out:
        raise RuntimeError(f"{way} request failed: {out.get('error', out)}")
    return out
