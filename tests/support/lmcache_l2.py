"""Drive LMCache L2 adapters the way ``lmcache server`` does, with or without the server.

Adapter level (no server): the adapter is built from the same ``--l2-adapter`` JSON through LMCache's own
parser and factory (l2_adapters.config / create_l2_adapter, as StorageManager does), keys come from
LMCache's own TokenHasher and ipc_key_to_object_keys (as the server's resolve_obj_keys makes them, the
chain tap recording them as the server module would), objects are KV_2LTD TensorMemoryObj chunks like
the server's L1, and tasks are submitted and collected through the adapter's event fds (select.poll, as
the store and prefetch controllers do; lmcache's bench helper wait_eventfd).

Server level: ``LMCacheServer`` runs ``lmcache server`` on loopback (CPU, lmcache_driven transfer over
shared memory) and ``store_prompt_kv`` stores a prompt's KV through LMCache's own CPU client
(``lmcache bench server``'s ServerBenchClient), filling its paged vLLM-layout KV first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid

import torch

from net import wait_until

CHUNK = 256
ADAPTER = {
    "type": "plugin",
    "module_path": "vericache_connector.integration.lmcache.l2_adapter",
    "class_name": "VeriCacheL2Adapter",
}
TAP_MODULE = {"module_path": "vericache_connector.integration.lmcache.chain_tap"}


def adapter_spec(params: dict, **outer) -> str:
    return json.dumps({**ADAPTER, "adapter_params": params, **outer})


def make_adapter(params: dict, spec: str | None = None):
    """An adapter from an --l2-adapter JSON, through LMCache's parser and factory."""
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import add_l2_adapters_args, parse_args_to_l2_adapters_config

    parser = add_l2_adapters_args(argparse.ArgumentParser())
    args = parser.parse_args(["--l2-adapter", spec or adapter_spec(params)])
    config = parse_args_to_l2_adapters_config(args).adapters[0]
    adapter = create_l2_adapter(config)
    adapter.set_backend_identity("plugin")
    return adapter


def lmcache_hashes(tokens: list[int]) -> list[bytes]:
    """The MP server's chunk hashes (its own TokenHasher, blake3)."""
    from lmcache.v1.multiprocess.token_hasher import TokenHasher

    return TokenHasher(chunk_size=CHUNK, hash_algorithm="blake3").compute_chunk_hashes(tokens)


def object_keys(tokens, model: str, salt: str = "", start: int = 0, end: int | None = None, tap: bool = True):
    """ObjectKeys of chunks [start, end) of tokens, as the server resolves a STORE; recorded by the tap."""
    from lmcache.v1.distributed.api import ipc_key_to_object_keys
    from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey

    from vericache_connector.integration.lmcache.chain_tap import observe

    end = len(tokens) // CHUNK * CHUNK if end is None else end
    ipc = IPCCacheServerKey(model, 1, 0, tuple(tokens), start, end, f"req-{uuid.uuid4().hex[:6]}", cache_salt=salt)
    hashes = lmcache_hashes(list(tokens))[start // CHUNK : end // CHUNK]
    resolved = ipc_key_to_object_keys(ipc, hashes, [0])
    if tap:
        observe(ipc, resolved, CHUNK)
    return resolved[0]


def chunk_tensors(layers, start: int = 0, end: int | None = None) -> list[torch.Tensor]:
    """Per-layer (k, v) [H, T, D] of a prefix -> LMCache's [2, L, 256, H*D] per chunk of [start, end)."""
    k0 = layers[0][0]
    end = k0.shape[1] // CHUNK * CHUNK if end is None else end
    out = []
    for s in range(start, end, CHUNK):
        t = torch.stack([torch.stack([k[:, s : s + CHUNK], v[:, s : s + CHUNK]]) for k, v in layers], dim=1)
        out.append(t.permute(0, 1, 3, 2, 4).reshape(2, len(layers), CHUNK, -1).contiguous())  # [2, L, T, H*D]
    return out


def memory_objects(tensors):
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

    objs = []
    for t in tensors:
        size = t.numel() * t.element_size()
        meta = MemoryObjMetadata(
            t.shape, t.dtype, 0, size, 1, fmt=MemoryFormat.KV_2LTD, shapes=[t.shape], dtypes=[t.dtype]
        )
        objs.append(TensorMemoryObj(raw_data=t.view(-1).view(torch.uint8), metadata=meta, parent_allocator=None))
    return objs


def random_layers(num_tokens: int, layers: int = 2, heads: int = 3, dim: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(heads, num_tokens, dim, generator=g), torch.randn(heads, num_tokens, dim, generator=g))
        for _ in range(layers)
    ]


class Driver:
    """Submit tasks and collect their results through the adapter's event fds."""

    def __init__(self, adapter, timeout: float = 30.0):
        self.adapter, self.timeout = adapter, timeout

    def _wait(self, efd: int, poll):
        from lmcache.cli.commands.bench.l2_adapter_bench.data import wait_eventfd

        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            got = poll()
            if got is not None:
                return got
            wait_eventfd(efd, timeout=0.2)
        raise TimeoutError("the adapter never completed the task")

    def store(self, keys, objs):
        tid = self.adapter.submit_store_task(keys, objs)
        done: dict = {}

        def poll():
            done.update(self.adapter.pop_completed_store_tasks())
            return done.get(tid)

        return self._wait(self.adapter.get_store_event_fd(), poll)

    def lookup(self, keys, descs=None) -> list[bool]:
        tid = self.adapter.submit_lookup_and_lock_task(keys, descs or {})
        bitmap = self._wait(
            self.adapter.get_lookup_and_lock_event_fd(), lambda: self.adapter.query_lookup_and_lock_result(tid)
        )
        self.adapter.submit_unlock(keys)
        return [bitmap.test(i) for i in range(len(keys))]

    def load(self, keys, objs) -> list[bool]:
        tid = self.adapter.submit_load_task(keys, objs)
        bitmap = self._wait(self.adapter.get_load_event_fd(), lambda: self.adapter.query_load_result(tid))
        return [bitmap.test(i) for i in range(len(keys))]


class LMCacheServer:
    """``lmcache server`` on loopback (CPU), with the chain tap and our adapter as its L2 tier."""

    def __init__(self, adapter_json: str, log_path: str, port: int, http_port: int, tap: bool = True):
        self.port, self.http_port, self.log_path = port, http_port, log_path
        args = [
            os.path.join(os.path.dirname(sys.executable), "lmcache"), "server",
            "--port", str(port), "--http-port", str(http_port), "--chunk-size", str(CHUNK),
            "--l1-size-gb", "0.5", "--eviction-policy", "LRU", "--disable-observability",
            "--l2-adapter", adapter_json,
        ]  # fmt: skip
        if tap:
            args += ["--server-module", json.dumps(TAP_MODULE)]
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # storage_backends
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=root)

    def wait_ready(self, seconds: float = 120.0) -> None:
        def ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"lmcache server exited ({self.proc.returncode}): {self.log()[-3000:]}")
            return "cache server is running" in self.log()

        if not wait_until(ready, seconds, 0.5):
            raise RuntimeError(f"lmcache server not ready in {seconds}s: {self.log()[-3000:]}")

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def bench_client(server: LMCacheServer, layers: int, heads: int, dim: int, num_blocks: int, dtype: str = "float32"):
    """LMCache's own CPU client (lmcache bench server): registers a paged KV of this shape over shared memory."""
    from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient
    from lmcache.cli.commands.bench.server_bench.config import BenchConfig

    cfg = BenchConfig(
        rpc_url=f"tcp://127.0.0.1:{server.port}",
        http_url=f"http://127.0.0.1:{server.http_port}",
        mode="cpu",
        transfer_mode="lmcache_driven",
        tp_size=1,
        use_mla=False,
        num_tokens=CHUNK,
        kvcache_shape_spec=f"(2,{num_blocks},16,{heads},{dim}):{dtype}:{layers}",
        num_blocks=num_blocks,
        block_size=16,
    )
    client = ServerBenchClient(cfg, log=lambda msg: None)
    client.start()
    return client


def _request(tokens: list[int]):
    from lmcache.cli.commands.bench.server_bench.client import RequestContext

    n = len(tokens) // CHUNK * CHUNK
    return n, RequestContext(
        sequence_id=0,
        request_id=f"vc-{uuid.uuid4().hex[:8]}",
        request_kind="vericache",
        token_ids=tuple(tokens),
        num_full_tokens=n,
        total_chunks=n // CHUNK,
        chunk_size=CHUNK,
        block_offset=0,
        num_blocks=n // 16,
    )


def store_prompt_kv(client, tokens: list[int], layers) -> bool:
    """Write a prompt's KV (per layer k/v [H, T, D]) into the client's paged KV (blocks 0..), then STORE
    its whole chunks through the server. True if the server stored it."""
    n, request = _request(tokens)
    worker = client._workers[0]  # the registered paged KV of rank 0: per layer [2, blocks, 16, H, D]
    for i, (k, v) in enumerate(layers):
        kv = worker.kv_caches[f"layer.{i}"]
        kv[0].view(-1, k.shape[0], k.shape[2])[:n] = k[:, :n].transpose(0, 1)
        kv[1].view(-1, v.shape[0], v.shape[2])[:n] = v[:, :n].transpose(0, 1)
    result = client.store(request, 0, n)
    return result is not None and result.succeeded


def retrieve_prompt_kv(client, tokens: list[int]) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]] | None]:
    """LOOKUP a prompt through the server (hit chunks), then RETRIEVE its whole chunks into the zeroed
    paged KV: (hit chunks, per layer k/v [H, T, D] as retrieved, or None if the retrieve failed)."""
    n, request = _request(tokens)
    worker = client._workers[0]
    for kv in worker.kv_caches.values():
        kv.zero_()
    hits = client.lookup(request).hit_chunks
    result = client.retrieve(request, 0, hits * CHUNK) if hits else None
    if result is None or not result.succeeded:
        return hits, None
    out = []
    for i in range(len(worker.kv_caches)):
        kv = worker.kv_caches[f"layer.{i}"]
        heads, dim = kv.shape[-2], kv.shape[-1]
        out.append(tuple(kv[j].reshape(-1, heads, dim)[: hits * CHUNK].transpose(0, 1).clone() for j in (0, 1)))
    return hits, out
