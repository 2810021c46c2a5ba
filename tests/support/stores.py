"""Helpers for the tests that talk to stores: fault injectors (a private killable redis-server, a server
that never answers; the relay that drops connections is net.TcpProxy), random KV, and `need`.

The store URL fixtures that use them live in tests/conftest.py. Servers come from .ci/services.sh, which
`make test` runs (.ci/with-services.sh): VERICACHE_REDIS_URL, VERICACHE_S3_ENDPOINT, or, for a server that
could not start, VERICACHE_REDIS_DOWN / VERICACHE_S3_DOWN naming why. A test whose server (or package) is
missing is SKIPPED with the reason locally, and FAILS in CI (CI=true), so a broken CI setup cannot pass
silently.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import socket
import subprocess
import threading
import time

import pytest

from net import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

IN_CI = os.environ.get("CI", "").lower() == "true"


def need(ok: bool, reason: str) -> None:
    """Skip (locally) or fail (CI=true) unless ok."""
    if not ok:
        if IN_CI:
            pytest.fail(f"required in CI: {reason}", pytrace=False)
        pytest.skip(reason)


def run(coro, timeout: float = 120):
    """Run a coroutine to completion in a fresh event loop, with an overall limit."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


# ---------------------------------------------------------------- fault helpers
class RedisProcess:
    """A private redis-server on a free loopback port, killable by its PID (with `password`: it asks for it; .url
    has none)."""

    def __init__(self, tmpdir: str, password: str | None = None):
        exe = shutil.which("redis-server")
        need(exe is not None, "redis-server binary is not installed (apt-get install redis-server)")
        self.port = free_port()
        self.proc = subprocess.Popen(
            [exe, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no", "--dir", tmpdir]
            + (["--requirepass", password] if password else []),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        else:
            self.kill()
            raise RuntimeError("private redis-server did not start")
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class SilentServer:
    """Accepts TCP connections and never answers (a hung store)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
                self.conns.append(conn)
            except OSError:
                return

    def close(self) -> None:
        self.closed = True
        for s in [self.sock, *self.conns]:
            s.close()


def closed_port() -> int:
    """A loopback port with nothing listening."""
    return free_port()


def random_kv(num_layers: int, heads: int, tokens: int, dim: int, dtype, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num_layers):
        k = torch.randn(heads, tokens, dim, generator=g)
        v = torch.randn(heads, tokens, dim, generator=g)
        out.append({"k": k.to(dtype), "v": v.to(dtype)})
    return out


def random_tokens(n: int, seed: int = 0) -> list[int]:
    import random

    rnd = random.Random(seed)
    return [rnd.randrange(0, 49152) for _ in range(n)]


def drop_memory_store(name: str) -> None:
    """Forget the named in-process store (local://NAME), so tests do not share data."""
    from storage_backends import local_connector

    with local_connector._MEMORY_LOCK:
        local_connector._MEMORY.pop(name, None)


async def corrupt_full_chunk(
    url: str, model: str, prefix: list[int], chunk: int, dtype, chunk_tokens: int = 256
) -> None:
    """Flip one byte in the middle of the stored full copy of one chunk of `prefix` (its manifest stays): a
    load of that chunk fails its check (CorruptObject)."""
    from storage_backends import DualCopyStore, Manifest

    async with DualCopyStore(url, model, dtype, chunk_tokens) as st:
        key = st.keys.chunks(prefix)[chunk].copy("full")
        m = Manifest.from_bytes(await st.backend.get(key), key)
        data = bytearray(await st.backend.get(m.payload_key))
        data[len(data) // 2] ^= 0x40
        await st.backend.put(m.payload_key, bytes(data))


async def break_manifest(
    url: str, model: str | None, prefix: list[int], chunk: int, delete: bool = False, chunk_tokens: int = 256
) -> None:
    """Flip one byte of the full-copy manifest of one chunk of `prefix` (a lookup then counts it a miss, as
    a corrupt manifest), or delete it (as an eviction would). model None: the in-process tests' model."""
    import torch

    from storage_backends import DualCopyStore

    if model is None:
        from vericache_connector.model.loader import model_identity, resolve_model_dir

        model = model_identity(resolve_model_dir(None), torch.float32)
    async with DualCopyStore(url, model, torch.float32, chunk_tokens) as st:
        key = st.keys.chunks(prefix)[chunk].copy("full")
        if delete:
            await st.backend.delete(key)
            return
        data = bytearray(await st.backend.get(key))
        data[len(data) // 2] ^= 0x40
        await st.backend.put(key, bytes(data))
