"""VeriCache storage layer: one async byte-store interface chosen by URL, and a
dual-copy (full + compressed) KV store on top of it. Heavy clients (redis,
boto3, nixl, lmcache) are imported lazily by the connector that needs them."""

from .base import (
    BackendOptions,
    CorruptObject,
    MissingObject,
    StorageBackend,
    StoreError,
    StoreUnavailable,
    redact_url,
)
from .credentials import Mac, read_secret_file, redact_text, secret_from_env
from .dual_store import DualCopyStore, PutResult
from .factory import open_backend
from .identity import dtype_str
from .keys import FULL, ChunkKey, KeySpace, chain_hashes, stored_prefix_len
from .manifest import LayerEntry, Manifest, UnauthenticatedObject, checksum
from .serialization import deserialize, read_header, serialize
from .throttle import ThrottledBackend, TokenBucket

__all__ = [
    "BackendOptions",
    "ChunkKey",
    "CorruptObject",
    "DualCopyStore",
    "FULL",
    "KeySpace",
    "LayerEntry",
    "Mac",
    "Manifest",
    "MissingObject",
    "PutResult",
    "StorageBackend",
    "StoreError",
    "StoreUnavailable",
    "ThrottledBackend",
    "TokenBucket",
    "UnauthenticatedObject",
    "chain_hashes",
    "checksum",
    "deserialize",
    "dtype_str",
    "open_backend",
    "read_header",
    "read_secret_file",
    "redact_text",
    "redact_url",
    "secret_from_env",
    "serialize",
    "stored_prefix_len",
]
