"""Settings of a remote dual-copy prefix store, shared by the engine's RemotePrefixCache and the vLLM
connector. RemoteCacheConfig is the one owner of the store timeout: it is passed explicitly to the
store's backend, and a URL that carries its own ``timeout_s`` is refused (two owners would disagree)."""

from __future__ import annotations

from dataclasses import dataclass

from storage_backends import redact_url
from storage_backends.base import query_options

SCHEMES = ("local", "redis", "rediss", "s3", "nixl")
DEFAULT_TIMEOUT_S = 5.0  # a lookup, a compressed fetch, one layer of the full stream (then: recompute)


@dataclass
class RemoteCacheConfig:
    url: str = "local://"
    compressor: str = "kivi4"
    chunk_size: int = 256
    bandwidth_bytes_per_s: float | None = None  # emulate a slow link (reads)
    timeout_s: float = DEFAULT_TIMEOUT_S  # every store operation, and a stalled full stream
    model_name: str | None = None  # default: the engine's model directory name

    def __post_init__(self):
        scheme = self.url.split("://", 1)[0].lower() if isinstance(self.url, str) and "://" in self.url else None
        if scheme not in SCHEMES:
            raise ValueError(f"bad store URL {self.url!r}: expected {', '.join(s + '://...' for s in SCHEMES)}")
        if "timeout_s" in query_options(self.url):
            raise ValueError(
                f"store URL {redact_url(self.url)!r} sets timeout_s: set it in the config "
                f"(RemoteCacheConfig.timeout_s / kv_connector_extra_config.timeout_s) instead"
            )
        if self.chunk_size <= 0:
            raise ValueError(f"chunk_size must be > 0, got {self.chunk_size}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.bandwidth_bytes_per_s is not None and self.bandwidth_bytes_per_s <= 0:
            raise ValueError(f"bandwidth_bytes_per_s must be > 0 or None, got {self.bandwidth_bytes_per_s}")
