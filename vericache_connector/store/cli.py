"""`vericache store stats [URL]` and `vericache store evict [URL] --max-bytes N | --older-than S`.

stats: what a dual-copy store holds, per model and copy kind (`full` or the compressor spec): entries
(manifests: chunks of full copies, prefixes of compressed copies), bytes (manifests + payloads), the oldest
and newest (the last write or refresh; on Redis the last access), orphaned payloads (their manifest gone:
an eviction of one key, a write cut short) and objects that are not the store's.
evict: for stores without a server-side policy (local:///dir, s3://): deletes whole chunks, both copies
together, least recently used first, until the store holds at most --max-bytes, and/or every chunk unused
for more than --older-than. Redis evicts by itself (maxmemory + allkeys-lru, or ttl_s): refused there.

URL defaults to $VERICACHE_STORE_URL (a store password then stays off the command line). Output shows the
URL redacted. Exit status 0, or 2 with one `vericache: error: ...` line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import time

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def byte_size(text: str) -> int:
    """'1000', '64M', '2GiB' (powers of 1024) -> bytes."""
    m = _SIZE.match(str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 1000000, 512M, 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def seconds(text: str) -> float:
    """'90', '15m', '2h', '7d' -> seconds."""
    m = _AGE.match(str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (e.g. 3600, 15m, 2h, 7d)")
    return float(m.group(1)) * _SECONDS[m.group(2).lower()]


def add_store_parser(sub) -> None:
    p = sub.add_parser("store", help="what a prefix store holds (stats); evict old entries (local, S3)")
    cmds = p.add_subparsers(dest="store_command", required=True)
    url_help = "store URL (default: $VERICACHE_STORE_URL)"
    s = cmds.add_parser("stats", help="entries, bytes per model and copy kind, oldest / newest")
    s.add_argument("url", nargs="?", default=None, help=url_help)
    s.add_argument("--json", action="store_true", help="one JSON object")
    e = cmds.add_parser("evict", help="delete least recently used chunks (both copies) of a local or S3 store")
    e.add_argument("url", nargs="?", default=None, help=url_help)
    which = e.add_mutually_exclusive_group(required=True)
    which.add_argument("--max-bytes", type=byte_size, default=None, help="keep at most this many bytes (512M, 2G)")
    which.add_argument("--older-than", type=seconds, default=None, help="delete chunks unused this long (s, 15m, 2h)")
    e.add_argument("--dry-run", action="store_true", help="say what would go, delete nothing")
    e.add_argument("--json", action="store_true", help="one JSON object")


def main(args: argparse.Namespace) -> int:
    from storage_backends import open_backend, redact_url

    url = args.url or os.environ.get("VERICACHE_STORE_URL")
    if not url:
        raise ValueError("no store URL: give one, or set VERICACHE_STORE_URL")
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme == "local" and not url.split("://", 1)[1].startswith("/"):
        raise ValueError(f"{redact_url(url)!r} is one process's memory: nothing to see from here (local:///dir)")
    if args.store_command == "evict" and scheme.startswith(("redis", "rediss")):
        raise ValueError(
            f"{redact_url(url)!r}: Redis evicts by itself (maxmemory + maxmemory-policy allkeys-lru, or ttl_s): "
            "evict is for local:///dir and s3:// stores"
        )
    backend = open_backend(url)
    shown = redact_url(url)
    if args.store_command == "stats":
        out = asyncio.run(_stats(backend))
        print(json.dumps({"url": shown, **out}, indent=2) if args.json else stats_text(shown, out))
        return 0
    got = asyncio.run(_evict(backend, args.max_bytes, args.older_than, args.dry_run))
    if args.json:
        print(json.dumps({"url": shown, "dry_run": args.dry_run, **got}, indent=2))
    else:
        verb = "would delete" if args.dry_run else "deleted"
        print(
            f"{shown}: {verb} {got['chunks']} chunks ({got['objects']} objects, {mb(got['bytes'])}); "
            f"{mb(got['left_bytes'])} left"
        )
    return 0


async def _stats(backend) -> dict:
    from storage_backends.inventory import summarize

    try:
        st = summarize([o async for o in backend.scan()])
    except NotImplementedError as e:
        raise ValueError(str(e)) from None
    finally:
        await backend.close()
    copies = [
        {"model": model, "copy": kind, "entries": c.entries, "bytes": c.bytes, "oldest": c.oldest, "newest": c.newest}
        for (model, kind), c in sorted(st.copies.items())
    ]
    return {
        "objects": st.objects,
        "bytes": st.bytes,
        "oldest": st.oldest,
        "newest": st.newest,
        "copies": copies,
        "orphans": st.orphans,
        "orphan_bytes": st.orphan_bytes,
        "other": st.other,
        "other_bytes": st.other_bytes,
    }


async def _evict(backend, max_bytes, older_than, dry_run) -> dict:
    from storage_backends.inventory import evict

    try:
        r = await evict(backend, max_bytes, older_than, dry_run)
    except NotImplementedError as e:
        raise ValueError(str(e)) from None
    finally:
        await backend.close()
    return {"chunks": r.groups, "objects": r.objects, "bytes": r.bytes, "left_bytes": r.left_bytes}


def mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n} bytes"


def when(t: float | None) -> str:
    if t is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t)) + f" ({max(0.0, time.time() - t):.0f} s ago)"


def stats_text(url: str, st: dict) -> str:
    lines = [f"{url}: {st['objects']} objects, {mb(st['bytes'])}"]
    if st["copies"]:
        w = max(5, *(len(c["model"]) for c in st["copies"]))
        cw = max(4, *(len(c["copy"]) for c in st["copies"]))
        lines.append(f"{'model':<{w}}  {'copy':<{cw}}  {'entries':>7}  {'bytes':>10}  oldest / newest (UTC)")
        for c in st["copies"]:
            lines.append(
                f"{c['model']:<{w}}  {c['copy']:<{cw}}  {c['entries']:>7}  {mb(c['bytes']):>10}  "
                f"{when(c['oldest'])} / {when(c['newest'])}"
            )
    lines.append(f"orphaned payloads (manifest gone): {st['orphans']} ({mb(st['orphan_bytes'])})")
    if st["other"]:
        lines.append(f"other objects: {st['other']} ({mb(st['other_bytes'])})")
    return "\n".join(lines)
