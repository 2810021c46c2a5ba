"""One async key/value interface over every remote store (factory.open_backend picks one by URL)."""

from __future__ import annotations

import asyncio
import logging
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import AsyncIterator, Iterable, Mapping, Sequence
from urllib.parse import parse_qs, urlsplit

from .credentials import redact_url

logger = logging.getLogger("vericache.store")


class StoreError(Exception):
    """Base class of every storage error; the engine falls back to recomputation. `chunk_start`: the first token
    of the full-copy chunk a read found missing or broken, where it is known (a repair rewrites that chunk)."""

    chunk_start: int | None = None


class StoreUnavailable(StoreError):
    """The store cannot be reached: down, timed out, or the connection dropped."""


class CorruptObject(StoreError):
    """A stored object fails its checksum, is truncated, or does not parse."""


class MissingObject(StoreError):
    """An object that a manifest (or the caller) expects is not in the store."""


@dataclass
class BackendOptions:
    """Options shared by all backends (each backend may take more)."""

    timeout_s: float = 10.0  # one operation (read/write) on a reachable store
    connect_timeout_s: float = 2.0  # establishing a connection

    @classmethod
    def pop_from(cls, opts: dict) -> "BackendOptions":
        """Take the shared options out of `opts` (URL query + keyword options); the rest stay."""
        defaults = cls()
        return cls(
            timeout_s=pop_float(opts, "timeout_s", defaults.timeout_s),
            connect_timeout_s=pop_float(opts, "connect_timeout_s", defaults.connect_timeout_s),
        )


@dataclass(frozen=True)
class ObjectInfo:
    """One stored object as StorageBackend.scan lists it."""

    key: str
    size: int
    used_at: float | None  # unix seconds of its last write or refresh (Redis: last access); None: unknown


class StorageBackend(ABC):
    """Async byte store. Keys are str, values bytes; every put is all-or-nothing."""

    url: str = ""
    # True when a use should refresh entries (touch): the store has a TTL or a capacity kept by recency
    refreshes: bool = False
    ttl_s: float | None = None  # entries expire this long after their last write or refresh

    @abstractmethod
    async def put(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    async def get(self, key: str) -> bytes | None:
        """The whole value, or None when the key is absent."""

    @abstractmethod
    async def get_range(self, key: str, start: int, end: int) -> bytes | None:
        """Bytes [start, end) of the value (shorter if the value is), None if absent."""

    @abstractmethod
    async def exists(self, key: str) -> bool: ...

    @abstractmethod
    async def delete(self, key: str) -> None:
        """Remove key; absent keys are fine."""

    async def put_many(self, items: Mapping[str, bytes]) -> None:
        await asyncio.gather(*(self.put(k, v) for k, v in items.items()))

    async def get_many(self, keys: Iterable[str]) -> list[bytes | None]:
        return list(await asyncio.gather(*(self.get(k) for k in keys)))

    async def exists_many(self, keys: Iterable[str]) -> list[bool]:
        return list(await asyncio.gather(*(self.exists(k) for k in keys)))

    async def touch(self, keys: Sequence[str]) -> None:
        """Mark keys used now: a TTL starts again, an LRU capacity sees them as recent. Later keys count as
        used more recently than earlier ones. Absent keys are fine. Default: nothing to do."""
        return None

    async def scan(self) -> AsyncIterator[ObjectInfo]:
        """Every stored object (for `vericache store stats` and `evict`); raises NotImplementedError where
        the store cannot list its keys."""
        raise NotImplementedError(f"{redact_url(self.url)}: this store cannot list its keys")
        yield  # pragma: no cover - makes this an async generator

    async def close(self) -> None:
        return None

    async def __aenter__(self) -> "StorageBackend":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {redact_url(self.url)}>"


def check_range(start: int, end: int) -> None:
    if start < 0 or end < start:
        raise ValueError(f"bad byte range [{start}, {end})")


ENCODE_HINT = "a password holding / ? # @ : [ ] or % must be percent-encoded (urllib.parse.quote(password, safe=''))"


def split_url(url: str):
    """urlsplit(url), whose own errors would quote the URL (a password too): ValueError, redacted."""
    try:
        return urlsplit(url)
    except ValueError:
        raise ValueError(f"bad store URL {redact_url(url)!r}: it does not parse ({ENCODE_HINT})") from None


def unknown_options(opts, url: str) -> ValueError:
    """The error for options a backend does not take. Names that are not plain identifiers (pieces of
    a URL that did not parse as meant, a password perhaps) are counted, not shown."""
    names = sorted(str(k) for k in opts)
    shown = [n for n in names if re.fullmatch(r"[\w.\-]{1,64}", n)]
    more = f" (and {len(names) - len(shown)} more, not shown)" if len(shown) < len(names) else ""
    return ValueError(f"unknown options {shown}{more} for store URL {redact_url(url)!r}")


def query_options(url: str) -> dict[str, str]:
    """Last value of each query parameter of url."""
    return {k: v[-1] for k, v in parse_qs(split_url(url).query).items()}


def pop_optional(opts: dict, name: str, kind=float):
    """Option name as a number > 0 (kind: float or int), or None when it is not given."""
    value = opts.pop(name, None)
    if value is None or value == "":
        return None
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"option {name}={value!r} is not {'an integer' if kind is int else 'a number'}") from None
    if not number > 0 or number != number or number == float("inf"):
        raise ValueError(f"option {name}={value!r} must be > 0 and finite")
    return number


def pop_float(opts: dict, name: str, default: float) -> float:
    value = opts.pop(name, default)
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"option {name}={value!r} is not a number") from None
    if value <= 0:
        raise ValueError(f"option {name}={value!r} must be > 0")
    return value
