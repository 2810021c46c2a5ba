"""Command-line options of `vericache verifier` and `vericache drafter` (kept apart from the servers, so
building the parser imports neither torch nor ZMQ). Secrets are never options: the store URL (it may carry
a password) comes from --store or $VERICACHE_STORE_URL, the verifier token from
$VERICACHE_VERIFIER_TOKEN_FILE (a mounted Secret) / $VERICACHE_VERIFIER_TOKEN or --token-file (a path), the
CURVE keys from the environment only (remote/auth.py: $VERICACHE_VERIFIER_SECRET_KEY_FILE and
$VERICACHE_VERIFIER_CLIENT_KEYS_FILE for the verifier, $VERICACHE_VERIFIER_CLIENT_SECRET_KEY_FILE and
$VERICACHE_VERIFIER_PUBLIC_KEY_FILE for a drafter)."""

from __future__ import annotations

from ..store.config import DEFAULT_TIMEOUT_S, STORE_DEFAULT, VERIFIER_LOAD_TIMEOUT_S
from .rpc import DEFAULT_PORT, MAX_CALL_BYTES
from .rpc import DEFAULT_TIMEOUT_S as VERIFY_TIMEOUT_S


def _common(p) -> None:
    p.add_argument("--store", default=None, help="store URL (default: $VERICACHE_STORE_URL, e.g. from a Secret)")
    p.add_argument("--model", default=None, help="checkpoint dir (default: the bundled SmolLM2-135M)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 in a pod)")
    p.add_argument("--chunk-size", type=int, default=256, help="the store's chunk size (tokens)")
    p.add_argument("--store-timeout-s", type=float, default=DEFAULT_TIMEOUT_S, help="per store operation")
    p.add_argument(
        "--bandwidth-bytes-per-s", type=float, default=None, help="emulate this node's link to the store (reads)"
    )
    p.add_argument("--mac-key-file", default=None, help="the store's MAC key file (default: $VERICACHE_MAC_KEY_FILE)")
    p.add_argument("--token-file", default=None, help="verifier token file (default: $VERICACHE_VERIFIER_TOKEN_FILE)")


def add_verifier_args(p) -> None:
    _common(p)
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="ZMQ port (0: any free one, printed)")
    p.add_argument("--memory-gb", type=float, default=4.0, help="resident full KV of all requests (LRU beyond)")
    p.add_argument("--ttl-s", type=float, default=30.0, help="free a request's KV after this long unused")
    p.add_argument("--max-batch", type=int, default=8, help="verify calls per forward")
    p.add_argument("--max-call-bytes", type=int, default=MAX_CALL_BYTES, help="larger calls are refused")
    p.add_argument(
        "--max-connections", type=int, default=256, help="admitted drafter connections (one beyond is closed at once)"
    )
    p.add_argument(
        "--max-pending",
        type=int,
        default=64,
        help="connections that have not shown an admitted key yet; one more evicts the oldest of them",
    )
    p.add_argument("--max-pending-per-address", type=int, default=8, help="of those, from one source address")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics at http://HOST:PORT/metrics (0: any free port, printed; default: off)",
    )


def add_drafter_args(p) -> None:
    import argparse

    from .drafter_api import REQUEST_HELP

    p.formatter_class = argparse.RawDescriptionHelpFormatter  # the request's fields and modes, lines as written
    p.epilog = REQUEST_HELP
    _common(p)
    p.add_argument("--port", type=int, default=8000, help="HTTP port (0: any free one, printed)")
    p.add_argument("--verifier", default=None, help="tcp://HOST:PORT (vericache verifier) or http://HOST:PORT (vLLM)")
    p.add_argument("--verifier-timeout-s", type=float, default=VERIFY_TIMEOUT_S, help="per verify call")
    p.add_argument(
        "--verifier-load-timeout-s",
        type=float,
        default=VERIFIER_LOAD_TIMEOUT_S,
        help="the first call (it waits for the full-KV load)",
    )
    p.add_argument("--compressor", default=STORE_DEFAULT, help="the compressed copy drafts run on")
    p.add_argument("--draft-weights", default="model", help="draft forward weights: model, bfloat16, int8")
    p.add_argument("--draft-layout", default="auto", help="draft cache layout: auto, paged, dense, materialized")


def store_config(args, **extra):
    """The RemoteCacheConfig of the options _common adds (the URL from --store or $VERICACHE_STORE_URL), plus
    what one server adds (the drafter's compressor and verifier)."""
    import os

    from ..store.config import RemoteCacheConfig

    url = args.store or os.environ.get("VERICACHE_STORE_URL")
    if not url:
        raise ValueError("no store: pass --store URL or set VERICACHE_STORE_URL (from a Secret)")
    return RemoteCacheConfig(
        url=url,
        chunk_size=args.chunk_size,
        bandwidth_bytes_per_s=args.bandwidth_bytes_per_s,
        timeout_s=args.store_timeout_s,
        mac_key_file=args.mac_key_file,
        **extra,
    )
