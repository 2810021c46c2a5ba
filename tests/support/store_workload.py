"""What the bounded / clustered store tests share (issue 40): redis-server processes of any role on loopback
ports (a cluster node, a replica, a Sentinel), and a workload of a tiny random-weight model through
RemotePrefixCache whose every output is checked against the same model's plain full-KV greedy decoding."""

from __future__ import annotations

import collections
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field

from net import free_port
from stores import need


class RedisNode:
    """redis-server (or a Sentinel, with sentinel=True: its config file is written in dir) on a free port of
    127.0.0.1, its own folder for any file it writes; kill() is SIGKILL, as a crash."""

    def __init__(self, dir, *args: str, sentinel: str | None = None):
        exe = shutil.which("redis-server")
        need(exe is not None, "redis-server binary is not installed (apt-get install redis-server)")
        self.port = free_port()
        self.dir = dir / str(self.port)
        self.dir.mkdir(parents=True)
        if sentinel is not None:
            conf = self.dir / "sentinel.conf"
            conf.write_text(f"port {self.port}\nbind 127.0.0.1\ndir {self.dir}\n{sentinel}")
            argv = [exe, str(conf), "--sentinel"]
        else:
            argv = [exe, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no"]
            argv += ["--dir", str(self.dir), *args]
            if "--cluster-enabled" in args:  # its bus port: by default port + 10000, which may be taken or > 65535
                argv += ["--cluster-port", str(free_port())]
        self.log = open(self.dir / "log", "w")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"redis-server {argv[1:]} did not start: {(self.dir / 'log').read_text()[-2000:]}")

    def client(self):
        import redis

        return redis.Redis(port=self.port, socket_timeout=5)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


@dataclass
class Workload:
    """A tiny model's prompts (chunks of 32 tokens) and their full-KV greedy outputs, computed once each."""

    prompts: int = 8
    tokens: tuple[int, int] = (130, 230)
    new_tokens: int = 8
    seed: int = 5
    refs: dict = field(default_factory=dict)
    paths: collections.Counter = field(default_factory=collections.Counter)
    wrong: list = field(default_factory=list)

    def __post_init__(self):
        import torch

        from vericache_connector.engine import DecodeConfig

        from tiny_model import tiny_engine

        self.engine = tiny_engine(seed=3)
        g = torch.Generator().manual_seed(self.seed)
        lo, hi = self.tokens
        lengths = torch.randint(lo, hi, (self.prompts,), generator=g).tolist()
        self.ids = [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]
        self.cfg = DecodeConfig(max_new_tokens=self.new_tokens, draft_k=4, stop_at_eos=False)

    def warm(self) -> "Workload":
        """A miss and a hit through an in-process store: the first request's one-off costs paid here."""
        import uuid

        name = f"warm{uuid.uuid4().hex[:8]}"
        with self.cache(f"local://{name}") as cache:
            for _ in range(2):
                cache.generate(self.ids[0], self.cfg)
        from stores import drop_memory_store

        drop_memory_store(name)
        return self

    def ref(self, i: int) -> list[int]:
        if i not in self.refs:
            self.refs[i] = self.engine.generate_full([self.engine.prefill(self.ids[i])], self.cfg)[0]
        return self.refs[i]

    def cache(self, url: str, **kw):
        from vericache_connector.remote import RemoteCacheConfig, RemotePrefixCache

        return RemotePrefixCache(self.engine, RemoteCacheConfig(url=url, chunk_size=32, **{"timeout_s": 2.0, **kw}))

    def ask(self, cache, i: int):
        """One request; its path counted, a wrong output recorded (the test asserts none)."""
        res = cache.generate(self.ids[i], self.cfg)
        self.paths[res.path] += 1
        if res.tokens != self.ref(i):
            self.wrong.append((i, res.path, res.error))
        return res

    @property
    def hit_rate(self) -> float:
        hits = sum(n for p, n in self.paths.items() if p in ("hit", "full-only"))  # something loaded
        return hits / max(1, sum(self.paths.values()))
