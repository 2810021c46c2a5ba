"""Settings of a remote dual-copy prefix store, shared by the engine's RemotePrefixCache and the vLLM
connector."""
from __future__ import annotations

from dataclasses import dataclass

SCHEMES = ("local", "redis", "rediss", "s3", "nixl")


@dataclass
class RemoteCacheConfig:
    url: str = "local://"
    compressor: str = "kivi4"
    chunk_size: int = 256
    bandwidth_bytes_per_s: float | None = None  # emulate a slow link (reads)
    timeout_s: float = 5.0                      # lookup, compressed fetch, and a stalled full stream
    model_name: str | None = None               # default: the engine's model directory name

    def __post_init__(self):
        scheme = self.url.split("://", 1)[0].lower() if isinstance(self.url, str) and "://" in self.url else None
        if scheme not in SCHEMES:
            raise ValueError(f"bad store URL {self.url!r}: expected {', '.join(s + '://...' for s in SCHEMES)}")
        if self.chunk_size <= 0:
            raise ValueError(f"chunk_size must be > 0, got {self.chunk_size}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.bandwidth_bytes_per_s is not None and self.bandwidth_bytes_per_s <= 0:
            raise ValueError(f"bandwidth_bytes_per_s must be > 0 or None, got {self.bandwidth_bytes_per_s}")
