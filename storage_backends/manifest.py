"""Manifests: the only thing readers trust.

Each copy of a prefix (``full`` chunk, or one compressed spec of the whole prefix)
has a manifest object written LAST, after its payload. It names the payload key
(content-addressed), its size, per-layer byte spans and checksums. A payload with
no manifest is invisible; a payload that disagrees with its manifest raises
CorruptObject. Manifest bytes: b"VCMF" | blake2b-128(json) | json.
"""

from __future__ import annotations

import hashlib
import json
import time
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

from .base import CorruptObject, MissingObject

MAGIC = b"VCMF"
KIND = "vericache.manifest"
VERSION = 1
ALGOS = ("blake2b", "crc32")


def checksum(data: bytes | memoryview, algo: str = "blake2b") -> str:
    if algo == "blake2b":
        return hashlib.blake2b(data, digest_size=16).hexdigest()
    if algo == "crc32":
        return f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"
    raise ValueError(f"unknown checksum algorithm {algo!r} (expected one of {ALGOS})")


@dataclass
class LayerEntry:
    offset: int
    length: int
    checksum: str

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass
class Manifest:
    key: str  # manifest key of this copy
    copy: str  # 'full' or a compressor spec
    model: str
    dtype: str
    payload_key: str
    size: int
    checksum: str  # of the whole payload
    layers: list[LayerEntry]
    start_token: int  # tokens of the prefix that the payload covers: [start, end)
    end_token: int
    algo: str = "blake2b"
    meta: dict[str, Any] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    kind: str = KIND
    version: int = VERSION

    @property
    def num_tokens(self) -> int:
        return self.end_token - self.start_token

    def to_bytes(self) -> bytes:
        body = json.dumps(asdict(self), separators=(",", ":"), sort_keys=True).encode()
        return MAGIC + hashlib.blake2b(body, digest_size=16).digest() + body

    @classmethod
    def from_bytes(cls, data: bytes, key: str | None = None) -> "Manifest":
        """Parse and self-check; ``key`` (if given) must be the key it was read from."""
        where = f"manifest {key!r}" if key else "manifest"
        if len(data) < 20 or data[:4] != MAGIC:
            raise CorruptObject(f"{where}: bad magic or truncated ({len(data)} bytes)")
        body = bytes(data[20:])
        if hashlib.blake2b(body, digest_size=16).digest() != data[4:20]:
            raise CorruptObject(f"{where}: checksum mismatch (corrupt or truncated)")
        try:
            raw = json.loads(body)
            if raw.get("kind") != KIND or raw.get("version") != VERSION:
                raise ValueError(f"kind/version {raw.get('kind')}/{raw.get('version')}")
            raw["layers"] = [LayerEntry(**e) for e in raw["layers"]]
            m = cls(**raw)
        except (ValueError, TypeError, KeyError) as e:
            raise CorruptObject(f"{where}: does not parse: {e}") from e
        if key is not None and m.key != key:
            raise CorruptObject(f"{where}: names another key {m.key!r}")
        return m

    def verify_payload(self, data: bytes | None) -> bytes:
        """The payload, after size and checksum checks."""
        return self._verify(data, "", self.size, self.checksum)

    def verify_layer(self, index: int, blob: bytes | None) -> bytes:
        """One layer's bytes (from a range read), after length and checksum checks."""
        entry = self.layers[index]
        return self._verify(blob, f" layer {index}", entry.length, entry.checksum)

    def _verify(self, data: bytes | None, part: str, length: int, digest: str) -> bytes:
        if data is None:
            raise MissingObject(f"payload {self.payload_key!r} listed in manifest {self.key!r} is missing")
        if len(data) != length:
            raise CorruptObject(
                f"payload {self.payload_key!r}{part} truncated or resized: "
                f"got {len(data)} bytes, manifest says {length}"
            )
        if checksum(data, self.algo) != digest:
            raise CorruptObject(f"payload {self.payload_key!r}{part}: {self.algo} checksum mismatch")
        return data
