"""Put/get throughput of each storage backend on loopback.

    python benchmarks/store_throughput.py --size-mb 64 --repeat 3 [--json]
    python benchmarks/store_throughput.py --backend redis --backend s3 --json

Backends: memory (local://), disk (local:///tmp/...), redis ($VERICACHE_REDIS_URL),
s3 ($VERICACHE_S3_ENDPOINT, moto or real), nixl (an in-process NixlStoreServer, or
--nixl-url). Unavailable backends are reported as skipped with the reason.
Reported MB/s = size / median seconds (MB = 1e6 bytes).
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file (python benchmarks/<script>.py): import from the repository root, as -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
import uuid

from benchmarks.kit import paths

paths.setup()

from storage_backends import open_backend  # noqa: E402

ALL = ["memory", "disk", "redis", "s3", "nixl"]


def backend_url(name: str, args, cleanup: list) -> str:
    tag = uuid.uuid4().hex[:8]
    if name == "memory":
        return f"local://bench-{tag}"
    if name == "disk":
        d = tempfile.mkdtemp(prefix="vc-bench-", dir=args.disk_dir)
        cleanup.append(lambda: __import__("shutil").rmtree(d, ignore_errors=True))
        return f"local://{d}"
    if name == "redis":
        url = args.redis_url or os.environ.get("VERICACHE_REDIS_URL")
        if not url:
            raise RuntimeError("no redis: set VERICACHE_REDIS_URL or --redis-url")
        return f"{url}?prefix=bench-{tag}:&timeout_s=60"
    if name == "s3":
        endpoint = args.s3_endpoint or os.environ.get("VERICACHE_S3_ENDPOINT")
        if not endpoint:
            raise RuntimeError("no S3 endpoint: set VERICACHE_S3_ENDPOINT or --s3-endpoint")
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")  # moto dummies when none set
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
        return f"s3://vericache-bench/{tag}?endpoint_url={endpoint}&region=us-east-1&timeout_s=120"
    if name == "nixl":
        if args.nixl_url:
            return args.nixl_url
        import logging

        import nixl  # noqa: F401  (configures its stdout logger on import)

        from storage_backends.nixl_server import NixlStoreServer

        logging.getLogger("nixl").setLevel(logging.WARNING)  # keep --json output clean
        server = NixlStoreServer(capacity_bytes=int(args.size_mb * 1e6 * 2.5) + (64 << 20)).start()
        cleanup.append(server.stop)
        return f"{server.url}?timeout_s=60"
    raise ValueError(f"unknown backend {name!r} (expected one of {ALL})")


async def measure(url: str, payload: bytes, repeat: int, range_mb: float) -> dict:
    b = open_backend(url)
    try:
        await b.put("warmup", b"x" * 1024)
        await b.get("warmup")
        puts, gets, ranges = [], [], []
        step = max(1, int(range_mb * 1e6))
        for _ in range(repeat):
            t = time.perf_counter()
            await b.put("payload", payload)
            puts.append(time.perf_counter() - t)
            t = time.perf_counter()
            data = await b.get("payload")
            gets.append(time.perf_counter() - t)
            if data != payload:
                raise RuntimeError("read back different bytes")
            del data
            t = time.perf_counter()
            n = 0
            for start in range(0, len(payload), step):  # layer-by-layer style range reads
                n += len(await b.get_range("payload", start, start + step))
            ranges.append(time.perf_counter() - t)
            if n != len(payload):
                raise RuntimeError("range reads returned wrong total")
        await b.delete("payload")
        await b.delete("warmup")
    finally:
        await b.close()
    mb = len(payload) / 1e6
    return {
        "put_MBps": round(mb / statistics.median(puts), 1),
        "get_MBps": round(mb / statistics.median(gets), 1),
        "range_get_MBps": round(mb / statistics.median(ranges), 1),
        "put_s": [round(x, 4) for x in puts],
        "get_s": [round(x, 4) for x in gets],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="storage backend put/get throughput on loopback")
    ap.add_argument("--backend", action="append", choices=ALL, help="repeatable; default: all")
    ap.add_argument("--size-mb", type=float, default=64.0, help="payload size in MB (1e6 bytes)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--range-mb", type=float, default=4.0, help="size of each range read")
    ap.add_argument("--redis-url")
    ap.add_argument("--s3-endpoint")
    ap.add_argument("--nixl-url")
    ap.add_argument("--disk-dir", default=None, help="parent dir for the disk store (default: tmp)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if args.size_mb <= 0 or args.repeat < 1:
        ap.error("--size-mb must be > 0 and --repeat >= 1")
    payload = os.urandom(int(args.size_mb * 1e6))
    results = {}
    for name in args.backend or ALL:
        cleanup: list = []
        try:
            url = backend_url(name, args, cleanup)
            results[name] = {"url": url.split("?")[0], **asyncio.run(measure(url, payload, args.repeat, args.range_mb))}
        except Exception as e:  # report and go on with the others
            results[name] = {"skipped": f"{type(e).__name__}: {e}"}
        finally:
            for fn in cleanup:
                fn()
    if args.json:
        print(json.dumps({"size_mb": args.size_mb, "repeat": args.repeat, "results": results}, indent=2))
    else:
        print(f"payload {args.size_mb:g} MB, median of {args.repeat}")
        print(f"{'backend':8} {'put MB/s':>10} {'get MB/s':>10} {'range MB/s':>11}")
        for name, r in results.items():
            if "skipped" in r:
                print(f"{name:8} skipped: {r['skipped']}")
            else:
                print(f"{name:8} {r['put_MBps']:>10} {r['get_MBps']:>10} {r['range_get_MBps']:>11}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
