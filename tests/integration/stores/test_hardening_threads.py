"""Issue 28, case 4: four threads sharing one RemotePrefixCache on a password-protected Redis that was
restarted once aborted the process once (`free(): corrupted unsorted chunks`); nothing kept two requests
from running at once on one cache. Now requests on one cache take turns (a lock), and a run of 4 threads
through a Redis restart, under glibc's heap checks (MALLOC_CHECK_=3 with its debug malloc preloaded), ends
cleanly with every output equal to the model's own full-KV greedy output, three times. Tiny random-weight
model (its exactness against itself is the point), so each run is a few seconds.

Run as a script, this file is the worker: python test_hardening_threads.py REDIS_URL (prints "half" when a
thread is half way, for the test to restart Redis then; then a JSON summary line)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from urllib.parse import quote

THREADS, ROUNDS, PROMPTS, NEW = 4, 2, 3, 8
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
SUPPORT = os.path.join(ROOT, "tests", "support")


def workload():
    import torch

    from vericache_connector.engine import DecodeConfig

    from tiny_model import tiny_engine

    engine = tiny_engine(seed=3)
    g = torch.Generator().manual_seed(11)
    prompts = [
        torch.randint(3, 256, (int(n),), generator=g).tolist() for n in torch.randint(90, 200, (PROMPTS,), generator=g)
    ]
    cfg = DecodeConfig(max_new_tokens=NEW, draft_k=4, stop_at_eos=False)
    return engine, prompts, cfg


def worker(url: str) -> None:
    from vericache_connector.remote import RemoteCacheConfig, RemotePrefixCache

    engine, prompts, cfg = workload()
    refs = [engine.generate_full([engine.prefill(p)], cfg)[0] for p in prompts]
    paths, wrong, half = Counter(), [], threading.Event()
    lock = threading.Lock()

    def run(t: int) -> None:
        for r in range(ROUNDS):
            for i in range(PROMPTS):
                j = (i + t) % PROMPTS  # the threads ask for the same prompts in different orders
                res = cache.generate(prompts[j], cfg)
                with lock:
                    paths[res.path] += 1
                    if res.tokens != refs[j]:
                        wrong.append((t, r, j, res.path))
            if r == 0 and not half.is_set():
                half.set()
                print("half", flush=True)

    with RemotePrefixCache(engine, RemoteCacheConfig(url=url, chunk_size=32, timeout_s=2.0)) as cache:
        threads = [threading.Thread(target=run, args=(t,)) for t in range(THREADS)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    print(json.dumps({"requests": sum(paths.values()), "wrong": wrong, "paths": paths}), flush=True)


# ---- the test side ----------------------------------------------------------------------------------------
class PasswordRedis:
    """redis-server with a password on a fixed loopback port; restart() keeps the port (and empties it)."""

    def __init__(self, tmpdir: str, password: str):
        self.exe, self.tmpdir, self.password = shutil.which("redis-server"), tmpdir, password
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://:{quote(password, safe='')}@127.0.0.1:{self.port}/0"
        self.proc = None
        self.start()

    def start(self) -> None:
        argv = [self.exe, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no"]
        argv += ["--dir", self.tmpdir, "--requirepass", self.password]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def restart(self) -> None:
        self.stop()
        self.start()


def heap_checked_env() -> dict[str, str]:
    env = {**os.environ, "MALLOC_CHECK_": "3", "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{SUPPORT}:{ROOT}"}
    for lib in ("/lib/x86_64-linux-gnu/libc_malloc_debug.so.0", "/usr/lib64/libc_malloc_debug.so.0"):
        if os.path.exists(lib):  # glibc >= 2.34 reads MALLOC_CHECK_ only with its debug malloc preloaded
            env["LD_PRELOAD"] = lib
            break
    return env


def test_a_shared_cache_survives_threads_and_a_store_restart_under_heap_checks(tmp_path):
    from stores import need

    need(
        shutil.which("redis-server") is not None, "redis-server binary is not installed (apt-get install redis-server)"
    )
    need(sys.platform.startswith("linux"), "glibc's MALLOC_CHECK_")
    redis = PasswordRedis(str(tmp_path), f"pw-{uuid.uuid4().hex[:12]}/#?")  # a password with URL specials
    try:
        for run in range(3):
            proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), redis.url],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=heap_checked_env(),
                cwd=ROOT,
            )
            lines = []
            for line in proc.stdout:
                lines.append(line.rstrip("\n"))
                if line.strip() == "half":
                    redis.restart()  # under load: some requests meet a store that is gone, then an empty one
            rc = proc.wait(180)
            out = "\n".join(lines[-40:])
            assert rc == 0, f"run {run}: the worker exited with {rc} (a negative number is a signal):\n{out}"
            summary = json.loads(next(line for line in reversed(lines) if line.startswith("{")))
            assert summary["requests"] == THREADS * ROUNDS * PROMPTS and summary["wrong"] == [], out
            paths = Counter(summary["paths"])
            # the restart emptied the store: a later lookup missed, or a hit's copy was gone when fetched
            assert paths["miss"] + paths["fallback-recompute"] + paths["hit-recompute"] > PROMPTS, paths
            assert redis.password not in out
    finally:
        redis.stop()


def test_concurrent_callers_take_turns(memory_url):
    """Deterministic: while one thread's request runs, no other enters the cache (before, all four did)."""
    from vericache_connector.remote import RemoteCacheConfig, RemotePrefixCache

    engine, prompts, cfg = workload()
    refs = [engine.generate_full([engine.prefill(p)], cfg)[0] for p in prompts]
    inside, most, outs = [0], [0], {}
    gate = threading.Lock()
    with RemotePrefixCache(engine, RemoteCacheConfig(url=memory_url, chunk_size=32)) as cache:
        remote = cache._remote

        def counted(r):
            with gate:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            time.sleep(0.02)  # widen the window a second caller would use
            try:
                return remote(r)
            finally:
                with gate:
                    inside[0] -= 1

        cache._remote = counted

        def run(t: int) -> None:
            outs[t] = [cache.generate(p, cfg).tokens for p in prompts]

        threads = [threading.Thread(target=run, args=(t,)) for t in range(THREADS)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    assert most[0] == 1
    assert all(outs[t] == refs for t in range(THREADS))


if __name__ == "__main__":
    sys.path[:0] = [SUPPORT, ROOT]
    worker(sys.argv[1])
