"""Manifests: the only thing readers trust.

Each copy of a prefix (``full`` chunk, or one compressed spec of the whole prefix)
has a manifest object written LAST, after its payload. It names the payload key
(content-addressed), its size, per-layer byte spans and checksums. A payload with
no manifest is invisible; a payload that disagrees with its manifest raises
CorruptObject. Manifest bytes: b"VCMF" | blake2b-128(json) | json.

Every field is type- and range-checked when parsed (spans inside the payload, tokens
start < end, ...): a manifest that parses is safe to act on. Checksums catch corruption,
not tampering; with a MAC key (credentials.Mac) the payload checksums are keyed BLAKE2b
(algo "blake2b-mac") and the manifest carries ``mac``, a keyed BLAKE2b over all its other
fields, so only a writer holding the key can make an entry a reader with the key accepts.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

from .base import CorruptObject, MissingObject
from .credentials import MAC_ALGO, Mac

MAGIC = b"VCMF"
KIND = "vericache.manifest"
VERSION = 1
ALGOS = ("blake2b", "crc32", MAC_ALGO)


class UnauthenticatedObject(CorruptObject):
    """An entry without a valid MAC (a reader with a key), or with one (a reader without a key)."""


def checksum(data: bytes | memoryview, algo: str = "blake2b", mac: Mac | None = None) -> str:
    if algo == "blake2b":
        return hashlib.blake2b(data, digest_size=16).hexdigest()
    if algo == "crc32":
        return f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"
    if algo == MAC_ALGO:
        if mac is None:
            raise ValueError(f"checksum algorithm {MAC_ALGO!r} needs a MAC key")
        return mac.tag(data, size=16)
    raise ValueError(f"unknown checksum algorithm {algo!r} (expected one of {ALGOS})")


class RunningChecksum:
    """checksum(payload, algo, mac) of a payload fed in pieces, in order: one pass over one that arrives in
    range reads. `length`: the whole payload's bytes (a keyed checksum binds it first)."""

    def __init__(self, algo: str, mac: Mac | None, length: int):
        checksum(b"", algo, mac)  # validates algo (and that a keyed one has its key)
        self.algo, self._crc = algo, 0
        self._h = (
            mac.hasher(length, size=16)
            if algo == MAC_ALGO
            else hashlib.blake2b(digest_size=16)
            if algo == "blake2b"
            else None
        )

    def update(self, data: bytes | memoryview) -> None:
        if self._h is None:
            self._crc = zlib.crc32(data, self._crc)
        else:
            self._h.update(data)

    def hexdigest(self) -> str:
        return f"{self._crc & 0xFFFFFFFF:08x}" if self._h is None else self._h.hexdigest()


def _canonical(fields: dict) -> bytes:
    return json.dumps(fields, separators=(",", ":"), sort_keys=True).encode()


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


_STR_FIELDS = ("key", "copy", "model", "dtype", "payload_key", "checksum", "algo", "kind", "mac")


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
    mac: str = ""  # keyed BLAKE2b over every other field ("" when written without a key)

    @property
    def num_tokens(self) -> int:
        return self.end_token - self.start_token

    def to_bytes(self, mac: Mac | None = None) -> bytes:
        fields = asdict(self)
        fields["mac"] = ""
        if mac is not None:
            fields.pop("mac")
            fields["mac"] = mac.tag(_canonical(fields))
        body = _canonical(fields)
        return MAGIC + hashlib.blake2b(body, digest_size=16).digest() + body

    @classmethod
    def from_bytes(cls, data: bytes, key: str | None = None, mac: Mac | None = None) -> "Manifest":
        """Parse and self-check; ``key`` (if given) must be the key it was read from. With ``mac``, the
        manifest must carry a valid tag (else UnauthenticatedObject); without, it must carry none."""
        where = f"manifest {key!r}" if key else "manifest"
        if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) < 20 or bytes(data[:4]) != MAGIC:
            raise CorruptObject(f"{where}: bad magic or truncated")
        body = bytes(data[20:])
        if hashlib.blake2b(body, digest_size=16).digest() != bytes(data[4:20]):
            raise CorruptObject(f"{where}: checksum mismatch (corrupt or truncated)")
        try:
            raw = json.loads(body)
            if not isinstance(raw, dict) or raw.get("kind") != KIND or raw.get("version") != VERSION:
                raise ValueError("not a vericache manifest of this version")
            unsigned = {k: v for k, v in raw.items() if k != "mac"}
            raw["layers"] = [LayerEntry(**e) for e in raw["layers"]]
            m = cls(**raw)
            m._check(where)
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
            raise CorruptObject(f"{where}: does not parse: {type(e).__name__}: {e}"[:500]) from None
        if mac is not None and (m.algo != MAC_ALGO or not mac.verify(m.mac, _canonical(unsigned))):
            raise UnauthenticatedObject(f"{where}: no valid MAC (written without the key, or tampered with)")
        if mac is None and (m.algo == MAC_ALGO or m.mac):
            raise UnauthenticatedObject(f"{where}: written with a MAC key, and this reader has none")
        if key is not None and m.key != key:
            raise CorruptObject(f"{where}: names another key {m.key!r}")
        return m

    def _check(self, where: str) -> None:
        """Types and ranges of every field, so that nothing downstream trips on a crafted manifest."""
        for name in _STR_FIELDS:
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} is not a string")
        if self.algo not in ALGOS:
            raise ValueError(f"unknown checksum algorithm {self.algo!r}")
        if not (_is_int(self.size) and self.size >= 0):
            raise ValueError(f"bad size {self.size!r}")
        if not (_is_int(self.start_token) and _is_int(self.end_token) and 0 <= self.start_token < self.end_token):
            raise ValueError(f"bad token range [{self.start_token!r}, {self.end_token!r})")
        if not isinstance(self.meta, dict) or not isinstance(self.created, (int, float)):
            raise ValueError("bad meta or created")
        if not self.layers:
            raise ValueError("no layers")
        for i, e in enumerate(self.layers):
            if not (_is_int(e.offset) and _is_int(e.length) and e.offset >= 0 and e.length >= 0):
                raise ValueError(f"layer {i}: bad span ({e.offset!r}, {e.length!r})")
            if e.end > self.size or not isinstance(e.checksum, str):
                raise ValueError(f"layer {i}: span [{e.offset}, {e.end}) outside the {self.size}-byte payload")

    def verify_payload(self, data: bytes | None, mac: Mac | None = None) -> bytes:
        """The payload, after size and checksum checks."""
        return self._verify(data, "", self.size, self.checksum, mac)

    def verify_layer(self, index: int, blob: bytes | None, mac: Mac | None = None) -> bytes:
        """One layer's bytes (from a range read), after length and checksum checks."""
        if not 0 <= index < len(self.layers):
            raise CorruptObject(f"manifest {self.key!r} has no layer {index} ({len(self.layers)} layers)")
        entry = self.layers[index]
        return self._verify(blob, f" layer {index}", entry.length, entry.checksum, mac)

    def check_whole(self, running: RunningChecksum) -> None:
        """The whole payload, read in ranges and fed to `running` in order, matches this manifest."""
        if not hmac.compare_digest(running.hexdigest(), self.checksum if self.checksum.isascii() else ""):
            raise CorruptObject(f"payload {self.payload_key!r}: {self.algo} checksum mismatch")

    def _verify(self, data: bytes | None, part: str, length: int, digest: str, mac: Mac | None = None) -> bytes:
        if data is None:
            raise MissingObject(f"payload {self.payload_key!r} listed in manifest {self.key!r} is missing")
        if len(data) != length:
            raise CorruptObject(
                f"payload {self.payload_key!r}{part} truncated or resized: "
                f"got {len(data)} bytes, manifest says {length}"
            )
        try:
            ok = digest.isascii() and hmac.compare_digest(checksum(data, self.algo, mac), digest)
        except ValueError as e:  # a keyed checksum and no key
            raise UnauthenticatedObject(f"payload {self.payload_key!r}{part}: {e}") from None
        if not ok:
            raise CorruptObject(f"payload {self.payload_key!r}{part}: {self.algo} checksum mismatch")
        return data
