"""DualCopyStore: each prefix stored twice, a full copy (per chunk) and compressed copies.

Reader path: ``get_compressed`` (small, whole prefix) to start drafting, while
``stream_full`` yields the full KV layer by layer, all chunks concatenated, as
soon as each layer has arrived. Writer path: ``put_prefix`` writes payloads,
then manifests (see manifest.py). Any fault raises StoreUnavailable,
CorruptObject or MissingObject and is logged on "vericache.store".

Integrity for a store shared with others (``mac_key``): every manifest carries a
keyed BLAKE2b tag and every payload checksum is keyed, so a writer without the
key cannot plant KV that a reader with the key accepts. With a key, an entry
without a valid tag is a miss with a warning (lookup/has_compressed do not count
it, get_compressed returns None, stream_full raises UnauthenticatedObject, a
CorruptObject). A reader without a key does not count entries written with one
either: lookup and has_compressed read and check the manifests with or without a
key (a manifest is a few KiB), so what they report present is what the reader
can load.
Payload reads are bounded by the manifest's size (a range read of size + 1
bytes), so a planted huge object is never read whole.

Bounded stores (docs/operations.md): on a backend that ``refreshes`` (a TTL, or a
capacity kept least recently used first), a hit refreshes what it uses, both
copies of each chunk (``lookup``: the full copy's manifests and payloads;
``has_compressed`` / ``get_compressed`` / ``stream_compressed``: the compressed
copy, where the backend has a TTL). A prefix's chunks are touched last chunk
first, so its first chunk counts as the most recent and an LRU eviction takes a
prefix from its end; ``put_prefix`` touches what it wrote the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Collection, Mapping, Sequence

import torch

from .base import CorruptObject, MissingObject, StorageBackend, StoreError, logger
from .credentials import MAC_ALGO, Mac
from .factory import open_backend
from .keys import FULL, ChunkKey, KeySpace, check_spec
from .manifest import LayerEntry, Manifest, RunningChecksum, UnauthenticatedObject, checksum
from .serialization import decode_layer, read_header, serialize
from .throttle import ThrottledBackend

Layers = Sequence[Mapping[str, torch.Tensor]]


@dataclass
class PutResult:
    prefix_key: str  # manifest key base of the whole prefix (its last chunk)
    num_tokens: int
    full_chunks_written: int = 0
    full_chunks_present: int = 0
    full_bytes: int = 0
    compressed_bytes: dict[str, int] = field(default_factory=dict)


class DualCopyStore:
    """Full + compressed KV copies of token prefixes in one backend.

    url: a store URL for open_backend (or an open StorageBackend).
    dtype: the model's KV dtype (part of every key, with model_name).
    bandwidth_bytes_per_s: emulate a slow link for reads (token bucket).
    write_batch_bytes: full chunks are serialized and written in batches this big.
    mac_key: a secret (>= 16 bytes; credentials.secret_from_env("VERICACHE_MAC_KEY") reads it from a
      mounted file or the environment) that keys a BLAKE2b MAC over each manifest and payload; None
      (the default) checks integrity with plain checksums, which catch corruption but not tampering.
    key_hashing, cache_salt: see keys.KeySpace ("lmcache": share the store with an LMCache server).
    """

    def __init__(
        self,
        url: str | StorageBackend,
        model_name: str,
        dtype: torch.dtype | str,
        chunk_size: int = 256,
        bandwidth_bytes_per_s: float | None = None,
        *,
        world_size: int = 1,
        worker_id: int = 0,
        algo: str = "blake2b",
        prefetch_layers: int = 2,
        write_batch_bytes: int = 64 << 20,
        mac_key: bytes | None = None,
        key_hashing: str = "vericache",
        cache_salt: str = "",
        **backend_opts,
    ):
        self.keys = KeySpace(model_name, dtype, chunk_size, world_size, worker_id, key_hashing, cache_salt)
        self._mac = Mac(mac_key) if mac_key is not None else None
        if self._mac is not None:
            if algo != "blake2b":
                raise ValueError(f"algo={algo!r} cannot be combined with mac_key (payloads are keyed BLAKE2b)")
            algo = MAC_ALGO
        checksum(b"", algo, self._mac)  # validates algo
        self.algo = algo
        if prefetch_layers < 1:
            raise ValueError(f"prefetch_layers must be >= 1, got {prefetch_layers}")
        self.prefetch_layers = prefetch_layers
        self.write_batch_bytes = write_batch_bytes
        raw = url if isinstance(url, StorageBackend) else open_backend(url, **backend_opts)
        self.raw_backend = raw
        self.backend = ThrottledBackend(raw, bandwidth_bytes_per_s) if bandwidth_bytes_per_s else raw

    @property
    def authenticated(self) -> bool:
        """Whether entries are MAC-checked (a mac_key was given)."""
        return self._mac is not None

    def __repr__(self) -> str:
        mac = ", mac" if self._mac is not None else ""
        return f"<DualCopyStore {self.backend!r} {self.keys.model_name}/{self.keys.dtype_name}{mac}>"

    async def close(self) -> None:
        await self.backend.close()

    async def __aenter__(self) -> "DualCopyStore":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ---------------------------------------------------------------- writes
    async def put_prefix(
        self,
        token_ids: Sequence[int],
        full_layers: Layers | None = None,
        compressed: Mapping[str, tuple[Mapping[str, Any], Layers]] | None = None,
        *,
        token_dim: int = 1,
        overwrite: bool = False,
        rewrite: Collection[int] = (),
    ) -> PutResult:
        """Store the full copy and/or compressed copies of the prefix token_ids.

        full_layers: one {"k": [H, T, D], "v": [H, T, D], ...} per layer for the
          whole prefix (T = len(token_ids) on ``token_dim``); split into chunks.
          Chunks already stored are skipped unless overwrite, or their first token is in
          `rewrite` (a repair: the chunks a read found broken, StoreError.chunk_start).
        compressed: {spec: (meta, layers)}, one layered payload per spec for the
          whole prefix. Full chunks are written before compressed copies, so a
          visible compressed copy implies a complete full copy.
        """
        chunks = self.keys.chunks(token_ids)
        if not chunks:
            raise ValueError("put_prefix: empty token_ids")
        n = chunks[-1].end
        result = PutResult(chunks[-1].base, n)
        if full_layers is not None:
            written = await self._put_full(chunks, full_layers, token_dim, overwrite, result, set(rewrite))
        for spec, value in (compressed or {}).items():
            check_spec(spec)
            if spec == FULL:
                raise ValueError("compressed copies cannot use the spec 'full'")
            try:
                meta, layers = value
            except (TypeError, ValueError):
                raise ValueError(f"compressed[{spec!r}] must be (meta, layers)") from None
            result.compressed_bytes[spec] = await self._put_copy(chunks[-1], spec, meta, layers, 0, n, overwrite)
        if full_layers is not None and self.backend.refreshes and self.backend.ttl_s is None:
            await self._touch_full(written)  # LRU: the prefix's first chunk the most recent
        return result

    async def _put_full(
        self,
        chunks: list[ChunkKey],
        layers: Layers,
        token_dim: int,
        overwrite: bool,
        result: PutResult,
        rewrite: set[int] = frozenset(),
    ) -> list[Manifest]:
        """Writes the chunks not stored yet; returns the manifests of every chunk it wrote or found."""
        n = chunks[-1].end
        if not layers:
            raise ValueError("full_layers is empty")
        for i, layer in enumerate(layers):
            if "k" not in layer or "v" not in layer:
                raise ValueError(f"full_layers[{i}] needs 'k' and 'v' tensors, has {sorted(layer)}")
            for name, t in layer.items():
                d = token_dim if token_dim >= 0 else t.dim() + token_dim
                if not 0 <= d < t.dim() or t.shape[d] != n:
                    raise ValueError(
                        f"full_layers[{i}][{name!r}] has shape {tuple(t.shape)}: expected {n} tokens on dim {token_dim}"
                    )
        present = [None] * len(chunks)
        if not overwrite:
            present = await self._full_present(chunks)
            present = [None if c.start in rewrite else p for c, p in zip(chunks, present)]
        todo = [c for c, p in zip(chunks, present) if not p]
        found = {c.start: p for c, p in zip(chunks, present) if isinstance(p, Manifest)}
        result.full_chunks_present = len(chunks) - len(todo)
        per_token = sum(t.numel() * t.element_size() for layer in layers for t in layer.values()) / n
        per_batch = max(1, int(self.write_batch_bytes // max(1.0, per_token * self.keys.chunk_size)))
        for b in range(0, len(todo), per_batch):
            batch = todo[b : b + per_batch]
            encoded = await asyncio.to_thread(self._encode_chunks, batch, layers, token_dim)
            await self.backend.put_many({m.payload_key: data for m, data in encoded})
            await self.backend.put_many({m.key: m.to_bytes(self._mac) for m, _ in encoded})  # manifests last
            result.full_chunks_written += len(batch)
            result.full_bytes += sum(len(d) for _, d in encoded)
            found.update((m.start_token, m) for m, _ in encoded)
        return [found[c.start] for c in chunks if c.start in found]

    async def _touch_full(self, manifests: list[Manifest]) -> None:
        """Refresh the full copy of a prefix's chunks (manifests in chunk order): last chunk first."""
        if manifests:
            await self._touch([k for m in reversed(manifests) for k in (m.key, m.payload_key)])

    async def _touch_copy(self, m: Manifest) -> None:
        """Refresh a compressed copy where entries expire (a TTL): LRU recency is the full copy's."""
        if self.backend.ttl_s is not None:
            await self._touch([m.payload_key, m.key])

    async def _touch(self, keys: list[str]) -> None:
        try:
            await self.backend.touch(keys)
        except StoreError as e:  # the entry is still there to use: only its refresh failed
            logger.warning("refresh of %d stored objects failed: %s", len(keys), e)

    async def _full_present(self, chunks: list[ChunkKey]) -> list[Manifest | bool]:
        """Which chunks' full copies need no write: a manifest that checks, or one under another key
        regime (with a MAC where this store has none, or the reverse: not this writer's to replace). A
        corrupt manifest is rewritten: lookup reports it missing, so nothing else would repair it."""
        keys = [c.copy(FULL) for c in chunks]
        out = []
        for c, key, raw in zip(chunks, keys, await self.backend.get_many(keys)):
            try:
                out.append(raw is not None and self._check_full(c, key, raw))
            except UnauthenticatedObject:
                out.append(True)
            except CorruptObject:
                out.append(False)
        return out

    def _encode_chunks(self, batch: list[ChunkKey], layers: Layers, token_dim: int):
        out = []
        for c in batch:
            part = [{k: t.narrow(token_dim, c.start, c.end - c.start) for k, t in layer.items()} for layer in layers]
            out.append(self.encode(c, FULL, {"token_dim": token_dim}, part, c.start, c.end))
        return out

    def encode(
        self, chunk: ChunkKey, spec: str, meta: Mapping[str, Any], layers: Layers, start: int, end: int
    ) -> tuple[Manifest, bytes]:
        """One copy of one chunk as this store writes it: (its manifest, its payload). Store the payload under
        `manifest.payload_key` and then `manifest.to_bytes(mac)` under `manifest.key` (manifest last), and
        every reader of this store checks it as its own (the LMCache L2 adapter writes LMCache's chunks so)."""
        data, spans = serialize(meta, layers)
        whole = checksum(data, self.algo, self._mac)
        view = memoryview(data)
        m = Manifest(
            key=chunk.copy(spec),
            copy=spec,
            model=self.keys.model_name,
            dtype=self.keys.dtype_name,
            payload_key=chunk.blob(spec, whole[:16]),
            size=len(data),
            checksum=whole,
            layers=[
                LayerEntry(s.offset, s.length, checksum(view[s.offset : s.end], self.algo, self._mac)) for s in spans
            ],
            start_token=start,
            end_token=end,
            algo=self.algo,
            meta={"token_dim": meta.get("token_dim")} if spec == FULL else {},
        )
        return m, data

    async def _put_copy(
        self, chunk: ChunkKey, spec: str, meta: Mapping[str, Any], layers: Layers, start: int, end: int, overwrite: bool
    ) -> int:
        m, data = await asyncio.to_thread(self.encode, chunk, spec, meta, layers, start, end)
        if not overwrite:
            old = await self.backend.get(m.key)
            if old is not None:
                try:
                    if Manifest.from_bytes(old, m.key, self._mac).checksum == m.checksum:
                        return len(data)  # identical copy already stored
                except CorruptObject:
                    pass  # replace a broken manifest
        await self.backend.put(m.payload_key, data)
        await self.backend.put(m.key, m.to_bytes(self._mac))  # manifest last
        return len(data)

    # ---------------------------------------------------------------- reads
    async def lookup(self, token_ids: Sequence[int]) -> int:
        """Number of leading tokens whose full copy is stored and readable by this store: the manifests
        are read and checked (this model, the chunk's tokens, and a valid MAC with a key, none without:
        a reader without the key does not count keyed entries it could not load)."""
        chunks = self.keys.chunks(token_ids)
        if not chunks:
            return 0
        keys = [c.copy(FULL) for c in chunks]
        hit, found = 0, []
        for c, key, raw in zip(chunks, keys, await self.backend.get_many(keys)):
            try:
                m = None if raw is None else self._check_full(c, key, raw)
            except CorruptObject as e:
                logger.warning("full copy of tokens [%d, %d) is a miss: %s", c.start, c.end, e)
                m = None
            if m is None:
                break
            hit = c.end
            found.append(m)
        if self.backend.refreshes:
            await self._touch_full(found)
        return hit

    async def has_compressed(self, token_ids: Sequence[int], spec: str) -> bool:
        """Whether compressed copy ``spec`` of exactly this prefix is stored and its manifest checks."""
        key = self.keys.prefix_key(token_ids).copy(check_spec(spec))
        try:
            m = await self._manifest(key)
        except CorruptObject:
            return False  # logged by _manifest
        if m is not None:
            await self._touch_copy(m)
        return m is not None

    def _parse(self, key: str, raw) -> Manifest:
        """A manifest read from key: parsed, authenticated (with a MAC key) and of this model/dtype."""
        m = Manifest.from_bytes(raw, key, self._mac)
        if (m.model, m.dtype) != (self.keys.model_name, self.keys.dtype_name):
            raise CorruptObject(
                f"manifest {key!r} is for {m.model}/{m.dtype}, not {self.keys.model_name}/{self.keys.dtype_name}"
            )
        return m

    async def _manifest(self, key: str) -> Manifest | None:
        raw = await self.backend.get(key)
        if raw is None:
            return None
        try:
            return self._parse(key, raw)
        except CorruptObject as e:
            logger.warning(
                "%s manifest: %s", "unauthenticated" if isinstance(e, UnauthenticatedObject) else "corrupt", e
            )
            raise

    async def get_compressed(
        self, token_ids: Sequence[int], spec: str
    ) -> tuple[dict, list[dict[str, torch.Tensor]]] | None:
        """(meta, layers) of compressed copy ``spec`` of exactly this prefix, or None (also for an
        entry without a valid MAC when this store has a key)."""
        from .serialization import deserialize

        key = self.keys.prefix_key(token_ids).copy(check_spec(spec))
        try:
            m = await self._manifest(key)
        except UnauthenticatedObject:
            return None  # a miss, logged
        if m is None:
            return None
        await self._touch_copy(m)
        try:
            # never more than the manifest's size (+1 to see a grown object): a planted huge object is not read
            data = m.verify_payload(await self.backend.get_range(m.payload_key, 0, m.size + 1), self._mac)
            return await asyncio.to_thread(deserialize, data)
        except StoreError as e:
            logger.warning("compressed copy %s unusable: %s", key, e)
            raise

    async def stream_compressed(self, token_ids: Sequence[int], specs: Sequence[str]) -> AsyncIterator[CopyLayer]:
        """Every layer of the compressed copies `specs` of exactly this prefix, one copy after the other, as
        they arrive: range reads of a layer each, the next issued as one lands, so the link carries the
        copies back to back (a reader that needs one copy whole before the next: split16's halves).

        Nothing is yielded if specs[0] is not stored (a miss, as get_compressed's None); MissingObject before
        anything is yielded if a later copy is not. Each layer is checked against its manifest checksum
        before it is yielded; `meta` (the payload header) is checked with the whole payload's checksum
        once the copy's last layer is in, so commit what the layers built only when the iteration ends
        without an error. Close the iterator (contextlib.aclosing) to stop early.
        """
        keys = [self.keys.prefix_key(token_ids).copy(check_spec(spec)) for spec in specs]
        try:
            manifests = await asyncio.gather(*(self._manifest(k) for k in keys))
        except UnauthenticatedObject:
            return  # a miss, logged
        if not manifests or manifests[0] is None:
            return
        for key, m in zip(keys, manifests):
            if m is None:
                raise MissingObject(f"compressed copy {key!r} is not stored (the first one is)")
            await self._touch_copy(m)
        queue: asyncio.Queue = asyncio.Queue(maxsize=self.prefetch_layers)
        fetcher = asyncio.create_task(self._fetch_ranges(manifests, queue))
        try:
            for copy, m in enumerate(manifests):
                whole = RunningChecksum(m.algo, self._mac, m.size)
                meta = _header_meta(m, await _next(queue), whole)
                for i in range(len(m.layers)):
                    tensors = await asyncio.to_thread(self._check_layer, m, i, await _next(queue), whole)
                    if i == len(m.layers) - 1:
                        m.check_whole(whole)
                    yield CopyLayer(copy, meta, i, len(m.layers), tensors)
        except StoreError as e:
            logger.warning("compressed copies %s unusable: %s: %s", list(specs), type(e).__name__, e)
            raise
        finally:
            fetcher.cancel()
            await asyncio.gather(fetcher, return_exceptions=True)

    async def _fetch_ranges(self, manifests: list[Manifest], queue: asyncio.Queue) -> None:
        """Each payload's header, then each of its layers, in order: bytes (or the error) onto the queue."""
        try:
            for m in manifests:
                await queue.put(await self.backend.get_range(m.payload_key, 0, m.layers[0].offset))
                for e in m.layers:
                    await queue.put(await self.backend.get_range(m.payload_key, e.offset, e.end))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, in order
            await queue.put(e)

    def _check_layer(self, m: Manifest, i: int, blob: bytes, whole: RunningChecksum) -> dict[str, torch.Tensor]:
        blob = m.verify_layer(i, blob, self._mac)
        whole.update(blob)
        return decode_layer(blob)

    async def stream_full(self, token_ids: Sequence[int]) -> AsyncIterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Yield (layer_idx, k, v) for the whole prefix, layer by layer, as layers arrive.

        token_ids must be fully stored (see lookup, which is chunk-aligned);
        otherwise MissingObject is raised before anything is yielded. To stop
        early, close the iterator (``contextlib.aclosing``) so the prefetch stops.
        """
        chunks = self.keys.chunks(token_ids)
        if not chunks:
            raise ValueError("stream_full: empty token_ids")
        try:
            manifests = await self._full_manifests(chunks)
        except StoreError as e:
            logger.warning("full copy of %d tokens unusable: %s: %s", chunks[-1].end, type(e).__name__, e)
            raise
        num_layers = len(manifests[0].layers)
        token_dim = manifests[0].meta.get("token_dim", 1)
        counts = [c.end - c.start for c in chunks]
        queue: asyncio.Queue = asyncio.Queue(maxsize=self.prefetch_layers)
        fetcher = asyncio.create_task(self._fetch_layers(manifests, num_layers, queue))
        try:
            for layer_idx in range(num_layers):
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                try:
                    k, v = await asyncio.to_thread(_join_layer, item, token_dim, counts)
                except CorruptObject as e:
                    logger.warning("full copy layer %d does not decode: %s", layer_idx, e)
                    raise
                yield layer_idx, k, v
        finally:
            fetcher.cancel()
            await asyncio.gather(fetcher, return_exceptions=True)

    async def _full_manifests(self, chunks: list[ChunkKey]) -> list[Manifest]:
        keys = [c.copy(FULL) for c in chunks]
        raws = await self.backend.get_many(keys)
        manifests = []
        for c, key, raw in zip(chunks, keys, raws):
            with _about(c.start):
                if raw is None:
                    raise MissingObject(
                        f"full copy of tokens [{c.start}, {c.end}) is not stored "
                        f"({self.keys.model_name}/{self.keys.dtype_name}, key {key!r})"
                    )
                m = self._check_full(c, key, raw)
                if manifests and len(m.layers) != len(manifests[0].layers):
                    raise CorruptObject(
                        f"manifest {key!r} has {len(m.layers)} layers, chunk 0 has {len(manifests[0].layers)}"
                    )
                if manifests and m.meta.get("token_dim") != manifests[0].meta.get("token_dim"):
                    raise CorruptObject(f"manifest {key!r}: token_dim differs from chunk 0's")
            manifests.append(m)
        return manifests

    def _check_full(self, c: ChunkKey, key: str, raw) -> Manifest:
        """The full-copy manifest of chunk c, checked (CorruptObject otherwise)."""
        m = self._parse(key, raw)
        if m.copy != FULL:
            raise CorruptObject(f"manifest {key!r} is of copy {m.copy!r}, not {FULL!r}")
        if (m.start_token, m.end_token) != (c.start, c.end):
            raise CorruptObject(
                f"manifest {key!r} covers tokens [{m.start_token}, {m.end_token}), expected [{c.start}, {c.end})"
            )
        token_dim = m.meta.get("token_dim", 1)
        if not (type(token_dim) is int and -8 <= token_dim < 8):
            raise CorruptObject(f"manifest {key!r}: bad token_dim {token_dim!r}")
        return m

    async def _fetch_layers(self, manifests: list[Manifest], num_layers: int, queue: asyncio.Queue) -> None:
        try:
            for layer_idx in range(num_layers):
                blobs = await asyncio.gather(*(self._fetch_layer(m, layer_idx) for m in manifests))
                await queue.put(blobs)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # hand the error to the consumer, in order
            logger.warning("full-copy stream failed at layer %d: %s: %s", layer_idx, type(e).__name__, e)
            await queue.put(e)

    async def _fetch_layer(self, m: Manifest, layer_idx: int) -> bytes:
        e = m.layers[layer_idx]
        blob = await self.backend.get_range(m.payload_key, e.offset, e.end)
        with _about(m.start_token):
            return m.verify_layer(layer_idx, blob, self._mac)

    async def get_full(self, token_ids: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """All layers of the full copy at once: [(k, v), ...]."""
        return [(k, v) async for _, k, v in self.stream_full(token_ids)]


@contextlib.contextmanager
def _about(chunk_start: int):
    """A CorruptObject / MissingObject raised inside is about the full-copy chunk starting at chunk_start."""
    try:
        yield
    except (CorruptObject, MissingObject) as e:
        if e.chunk_start is None:
            e.chunk_start = chunk_start
        raise


@dataclass(frozen=True)
class CopyLayer:
    """One layer of a compressed copy, as DualCopyStore.stream_compressed yields it."""

    copy: int  # index of the copy in the specs asked for
    meta: dict  # the copy's meta (its payload header)
    index: int  # layer
    count: int  # layers in the copy
    tensors: dict[str, torch.Tensor]


async def _next(queue: asyncio.Queue):
    item = await queue.get()
    if isinstance(item, BaseException):
        raise item
    return item


def _header_meta(m: Manifest, header: bytes | None, whole: RunningChecksum) -> dict:
    """The meta of a payload from its header bytes, which must lay the layers out exactly as the manifest
    does, back to back up to its end (so header + layers is the whole payload the checksum covers)."""
    if header is None or len(header) != m.layers[0].offset:
        raise MissingObject(f"payload {m.payload_key!r} listed in manifest {m.key!r} is missing or truncated")
    meta, spans = read_header(header)
    laid_out = [(s.offset, s.length) for s in spans] == [(e.offset, e.length) for e in m.layers]
    starts = [len(header)] + [e.end for e in m.layers[:-1]]
    if not laid_out or [e.offset for e in m.layers] != starts or m.layers[-1].end != m.size:
        raise CorruptObject(f"payload {m.payload_key!r}: its header's layers differ from manifest {m.key!r}")
    whole.update(header)
    return meta


def _join_layer(blobs: list[bytes], token_dim: int, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer of the whole prefix from its per-chunk blobs; each chunk's k and v must hold exactly its
    tokens on token_dim and agree with chunk 0 in dtype and every other dim."""
    parts = [decode_layer(b) for b in blobs]
    out = []
    for name in ("k", "v"):
        ts = []
        for i, (p, n) in enumerate(zip(parts, counts)):
            t = p.get(name)
            if not isinstance(t, torch.Tensor):
                raise CorruptObject(f"full-copy layer of chunk {i} lacks tensor {name!r}")
            d = token_dim if token_dim >= 0 else t.dim() + token_dim
            if not 0 <= d < t.dim() or t.shape[d] != n:
                raise CorruptObject(
                    f"full-copy chunk {i} {name!r} has shape {tuple(t.shape)}: expected {n} tokens on dim {token_dim}"
                )
            if ts and (t.dtype != ts[0].dtype or t.dim() != ts[0].dim() or _other_dims(t, d) != _other_dims(ts[0], d)):
                raise CorruptObject(f"full-copy chunk {i} {name!r} is {t.dtype}{tuple(t.shape)}, chunk 0 differs")
            ts.append(t)
        out.append(ts[0] if len(ts) == 1 else torch.cat(ts, dim=token_dim))
    return out[0], out[1]


def _other_dims(t: torch.Tensor, d: int) -> tuple[int, ...]:
    return tuple(t.shape[:d]) + tuple(t.shape[d + 1 :])
