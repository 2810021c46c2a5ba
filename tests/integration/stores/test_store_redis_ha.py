"""Past one Redis (issue 40, item 3), real servers on loopback, a tiny model's outputs checked against its own
plain full-KV greedy decoding:

- a 3-master Redis Cluster (`redis-server --cluster-enabled yes` x 3 + `redis-cli --cluster create`) serves
  hits, each chunk's manifest and payloads on one shard (a hash tag);
- a Sentinel failover: the master killed while a request streams its full copy; that request and every one
  after it is exact (recomputed while no master answers), and hits resume on the promoted replica."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time

import pytest

from storage_backends import ThrottledBackend

from net import wait_for
from store_workload import RedisNode, Workload
from stores import need


@pytest.fixture(scope="module")
def wl():
    return Workload(prompts=6, tokens=(130, 200))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    need(shutil.which("redis-cli") is not None, "redis-cli is not installed (apt-get install redis-tools)")
    tmp = tmp_path_factory.mktemp("cluster")
    nodes = []
    try:
        for _ in range(3):
            nodes.append(RedisNode(tmp, "--cluster-enabled", "yes", "--cluster-node-timeout", "2000"))
        subprocess.run(
            ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in nodes), "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        for n in nodes:
            wait_for(
                lambda n=n: n.client().cluster("info")["cluster_state"] == "ok",
                20.0,
                0.1,
                what="cluster_state:ok",
                ignore=Exception,
            )
        yield nodes
    finally:
        for n in nodes:
            n.kill()


def test_a_three_master_cluster_serves_exact_hits(wl, cluster):
    url = f"redis+cluster://127.0.0.1:{cluster[0].port},127.0.0.1:{cluster[1].port}?prefix=c:"
    with wl.cache(url) as cache:
        for i in range(len(wl.ids)):
            assert wl.ask(cache, i).path == "miss"
        for i in range(len(wl.ids)):
            res = wl.ask(cache, i)
            assert res.path == "hit" and res.tokens == wl.ref(i), (res.path, res.error)
    assert not wl.wrong
    by_node = [[k.decode() for k in n.client().scan_iter(match="c:*")] for n in cluster]
    assert sum(1 for keys in by_node if keys) == 3, "the chunks are not spread over the three masters"
    for keys in by_node:  # every payload on the shard of its manifest
        manifests = {k for k in keys if "@blob%" not in k}
        assert all(k.rpartition("@blob%")[0] in manifests for k in keys if "@blob%" in k)


@pytest.fixture
def sentinel(tmp_path):
    master = RedisNode(tmp_path, "--repl-diskless-sync-delay", "0")
    replica = RedisNode(tmp_path, "--replicaof", "127.0.0.1", str(master.port), "--repl-diskless-sync-delay", "0")
    conf = (
        f"sentinel monitor vc 127.0.0.1 {master.port} 1\n"
        "sentinel down-after-milliseconds vc 500\nsentinel failover-timeout vc 3000\n"
    )
    watcher = RedisNode(tmp_path, sentinel=conf)
    try:
        wait_for(
            lambda: replica.client().info("replication")["master_link_status"] == "up",
            20.0,
            0.1,
            what="replica in sync",
            ignore=Exception,
        )
        yield master, replica, watcher
    finally:
        for n in (watcher, replica, master):
            n.kill()


class KillMidStream(ThrottledBackend):
    """The store as it was, but the first read of a full copy's payload first runs kill(): the master dies
    after the request found both copies and fetched the compressed one, while its full copy streams."""

    def __init__(self, inner, kill):
        super().__init__(inner, None)
        self.kill = kill

    async def get_range(self, key: str, start: int, end: int):
        if self.kill is not None and "@copy%full@blob%" in key:
            kill, self.kill = self.kill, None
            await asyncio.to_thread(kill)
        return await super().get_range(key, start, end)


def test_a_sentinel_failover_mid_request_loses_nothing(wl, sentinel):
    master, replica, watcher = sentinel
    url = f"redis+sentinel://127.0.0.1:{watcher.port}/vc?prefix=s:"
    with wl.cache(url) as cache:
        for i in range(len(wl.ids)):
            assert wl.ask(cache, i).path == "miss"
        assert master.client().wait(1, 5000) == 1  # every write on the replica
        cache.store.backend = KillMidStream(cache.store.backend, master.kill)
        during = wl.ask(cache, 0)  # the master dies while its full copy streams in
        # The kill runs on a thread the failed stream may have stopped awaiting, and Popen.poll() answers None
        # while that thread's wait() holds the reaping lock: wait for the exit instead of sampling it.
        assert master.proc.wait(10) is not None
        assert during.path == "hit-recompute" and "ConnectionError" in during.error, (during.path, during.error)
        paths = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # requests go on through the failover
            for i in range(len(wl.ids)):
                paths.append(wl.ask(cache, i).path)
            if paths[-len(wl.ids) :].count("hit") == len(wl.ids):
                break
    assert not wl.wrong, wl.wrong
    assert paths[-len(wl.ids) :] == ["hit"] * len(wl.ids), paths  # hits resumed, on the promoted replica
    assert replica.client().info("replication")["role"] == "master"
