"""LMCache multiprocess-mode L2 adapter: an ``lmcache server`` storage tier on VeriCache's dual-copy store.

    lmcache server --l1-size-gb 8 --eviction-policy LRU \\
      --server-module '{"module_path": "vericache_connector.integration.lmcache.chain_tap"}' \\
      --l2-adapter '{"type": "plugin", "module_path": "vericache_connector.integration.lmcache.l2_adapter",
                     "class_name": "VeriCacheL2Adapter",
                     "adapter_params": {"url": "redis://redis:6379/0", "kv_dtype": "bfloat16",
                                        "compressor": "kivi4", "model_dir": "/models/Llama-3.1-8B",
                                        "served_model": "meta-llama/Llama-3.1-8B"}}'

VeriCache nodes that read and write the same prefixes use the same store with
``RemoteCacheConfig(url=..., key_hashing="lmcache")`` (and the same model id: ``model_dir`` gives the
'folder.fingerprint' the engine and the vLLM connector use). adapter_params: integration/lmcache/l2_config.py.
Leave the adapter's "serde" unset: VeriCache readers need the KV itself.

Keys: ObjectKey (model, chunk hash, kv rank, cache salt) -> KeySpace(model id, kv_dtype, chunk_size,
world, worker, hashing="lmcache", cache_salt) (lmcache_keys.py). Only object group 0 of KV_2LTD
objects (LMCache's layout of a vLLM chunk) is stored; anything else is skipped with a warning.

Store task: each chunk is written as a full-copy chunk, payloads first, manifests last; chunks already
stored are skipped. A full-copy manifest names the chunk's token range, which the L2 interface does not
give: the chain tap (integration/lmcache/chain_tap.py, the server module above) records it. A chunk the tap does not
know is written under the copy tag "lmcache" instead (range [0, T), read only by this adapter), so a
VeriCache reader never meets a full copy with a wrong range. The task completes when the full copies
are stored; then, for each prefix the task ends whose chunks the tap knows, the adapter reads the full
copy back (checked), compresses it and writes the compressed copy, manifest last: VeriCache readers
then get compressed-first hits.
Lookup: a manifest present (with a MAC key: present and authentic). Load: the checked payload, every
layer of the buffer's shape and dtype, into LMCache's buffer. Anything else is a miss with a warning
(bit 0), as is any store fault: LMCache recomputes, it never gets bad data. No eviction (the store is
persistent, capacity 0), so locks are no-ops.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections import OrderedDict

import torch
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.platform import create_event_notifier

from storage_backends.base import CorruptObject, StorageBackend, StoreError
from storage_backends.credentials import Mac, read_secret_file, redact_url, secret_from_env
from storage_backends.dual_store import DualCopyStore
from storage_backends.factory import open_backend
from storage_backends.keys import FULL, ChunkKey
from storage_backends.lmcache_keys import ModelNaming, kv_rank_layout, resolve_model_id
from storage_backends.manifest import Manifest
from storage_backends.serialization import deserialize

from .chain_tap import TAP
from .l2_config import L2Settings, Unfit, VeriCacheL2AdapterConfig, fill, kv_layout, store_compressor, to_layers

__all__ = ["L2Settings", "VeriCacheL2Adapter", "VeriCacheL2AdapterConfig"]
logger = logging.getLogger("vericache.store")
LOOSE = "lmcache"  # copy tag of a chunk whose place in its prefix is unknown
MAC_ENV = "VERICACHE_MAC_KEY"
BATCH_BYTES = 64 << 20  # full chunks encoded and written per batch
MAX_SPACES = 1024  # (model, rank, salt) key spaces kept
FAULTS = (StoreError, OSError, asyncio.TimeoutError)


class VeriCacheL2Adapter(L2AdapterInterface):
    def __init__(self, config: VeriCacheL2AdapterConfig | dict, l1_memory_desc=None):
        super().__init__(max_capacity_bytes=0)
        s = config.settings if isinstance(config, VeriCacheL2AdapterConfig) else L2Settings.from_params(dict(config))
        self.settings, self.dtype, self.head_dim = s, s.dtype, s.resolved_head_dim()
        ident = {"model_id": s.model_id, "model_dir": s.model_dir, "model_name": s.model_name}
        self.naming = ModelNaming(resolve_model_id(ident, s.kv_dtype), s.served_model)
        secret = (
            read_secret_file(s.mac_key_file, "MAC key") if s.mac_key_file else secret_from_env(MAC_ENV, what="MAC key")
        )
        self._mac_key, self._mac = secret, (Mac(secret) if secret is not None else None)
        self.compressor = store_compressor(s.compressor, self.head_dim)
        self.backend: StorageBackend = open_backend(s.url, timeout_s=s.timeout_s)
        self._spaces: OrderedDict[tuple, DualCopyStore] = OrderedDict()  # loop thread only
        self._efd = {op: create_event_notifier() for op in ("store", "lookup", "load")}
        self._done: dict[str, dict] = {op: {} for op in self._efd}
        self._lock, self._ids, self._jobs, self._closed = threading.Lock(), itertools.count(), set(), False
        self.stats = dict.fromkeys(("stored", "store_failed", "hits", "misses", "compressed", "faults"), 0)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vericache-l2", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        mac = " mac" if self._mac is not None else ""
        return f"<VeriCacheL2Adapter {redact_url(self.settings.url)} {self.naming.model_id or '(LMCache names)'}{mac}>"

    # ---- tasks: run on the loop thread, completed through the event fds ----------------------------
    def get_store_event_fd(self) -> int:
        return self._efd["store"].fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._efd["lookup"].fileno()

    def get_load_event_fd(self) -> int:
        return self._efd["load"].fileno()

    def _submit(self, op: str, coro, failed) -> int:
        with self._lock:
            task_id = next(self._ids)
        asyncio.run_coroutine_threadsafe(self._run(op, task_id, coro, failed), self._loop)
        return task_id

    async def _run(self, op: str, task_id: int, coro, failed) -> None:
        try:
            result = await coro
        except Exception as e:  # noqa: BLE001 - LMCache always gets an answer: a failure, a miss
            logger.warning("lmcache L2 %s task failed: %s: %s", op, type(e).__name__, e)
            self.stats["faults"] += 1
            result = failed
        with self._lock:
            self._done[op][task_id] = result
        self._efd[op].notify()

    def submit_store_task(self, keys, objects) -> int:
        return self._submit("store", self._store(list(keys), list(objects)), L2StoreResult(False, 0))

    def pop_completed_store_tasks(self) -> dict:
        with self._lock:
            done, self._done["store"] = self._done["store"], {}
        return done

    def submit_lookup_and_lock_task(self, keys, group_layout_descs) -> int:
        keys = list(keys)
        return self._submit("lookup", self._lookup(keys, dict(group_layout_descs or {})), Bitmap(len(keys)))

    def query_lookup_and_lock_result(self, task_id: int):
        with self._lock:
            return self._done["lookup"].pop(task_id, None)

    def submit_unlock(self, keys) -> None:
        return None  # nothing is evicted, nothing is locked

    def submit_load_task(self, keys, objects) -> int:
        keys = list(keys)
        return self._submit("load", self._load(keys, list(objects)), Bitmap(len(keys)))

    def query_load_result(self, task_id: int):
        with self._lock:
            return self._done["load"].pop(task_id, None)

    def report_status(self) -> dict:
        where = redact_url(self.settings.url)
        return {"is_healthy": self._thread.is_alive(), "type": type(self).__name__, "store": where, **self.stats}

    def close(self) -> None:
        async def drain():
            me = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not me]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.backend.close()

        if self._closed:
            return
        self._closed, wait = True, self.settings.timeout_s * 2
        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(drain(), self._loop).result(wait)
            except Exception as e:  # noqa: BLE001 - closing must not raise
                logger.warning("VeriCacheL2Adapter close: %s: %s", type(e).__name__, e)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(wait)
        if not self._thread.is_alive() and not self._loop.is_closed():
            self._loop.close()
        for efd in self._efd.values():
            efd.close()

    # ---- keys --------------------------------------------------------------------------------------
    def _space(self, key) -> DualCopyStore:
        """The store (key space) of an ObjectKey's model, rank and salt; Unfit for a key we do not store."""
        if key.object_group_id != 0:
            raise Unfit(f"object group {key.object_group_id} (only group 0, the attention KV, is stored)")
        world, worker = kv_rank_layout(key.kv_rank)
        ident = (key.model_name, world, worker, key.cache_salt)
        store = self._spaces.get(ident)
        if store is None:
            model = self.naming.key_model(key.model_name)
            store = DualCopyStore(
                self.backend, model, self.dtype, self.settings.chunk_size, world_size=world, worker_id=worker,
                mac_key=self._mac_key, key_hashing="lmcache", cache_salt=key.cache_salt,
            )  # fmt: skip
            self._spaces[ident] = store
            if len(self._spaces) > MAX_SPACES:
                self._spaces.popitem(last=False)
        self._spaces.move_to_end(ident)
        return store

    def _base(self, key) -> tuple[DualCopyStore, ChunkKey]:
        store, h = self._space(key), int.from_bytes(key.chunk_hash, "big")
        return store, ChunkKey(store.keys.base_key(h), h, 0, self.settings.chunk_size)

    def _chunk(self, key, tokens: int) -> tuple[DualCopyStore, ChunkKey, str, list[int] | None]:
        """(store, chunk key with its token range, copy tag, the prefix's token ids if the tap knows them)."""
        store, loose = self._base(key)
        prefix = TAP.prefix_tokens(key.chunk_hash)
        if prefix and tokens == self.settings.chunk_size and len(prefix) % tokens == 0:
            chunk = store.keys.chunks(prefix)[-1]
            if chunk.chunk_hash == loose.chunk_hash:
                return store, chunk, FULL, prefix
        return store, ChunkKey(loose.base, loose.chunk_hash, 0, tokens), LOOSE, None

    # ---- store -------------------------------------------------------------------------------------
    async def _store(self, keys, objects) -> L2StoreResult:
        ok, faulted, nbytes, stored, sizes, tips = True, False, 0, [], [], {}
        try:
            plan = []
            for key, obj in zip(keys, objects, strict=True):
                try:
                    _, tokens, _ = kv_layout(obj, self.dtype, self.head_dim, self.settings.chunk_size)
                    store, chunk, copy, prefix = self._chunk(key, tokens)
                except ValueError as e:  # Unfit, or a model name our keys cannot carry
                    logger.warning("lmcache L2 store: %s not stored: %s", key, e)
                    ok = False
                    continue
                plan.append((key, obj, store, chunk, copy))
                if prefix is not None:
                    tips[chunk.base] = (store, prefix)
            # a chunk is there if its full copy is, or (position unknown) its loose copy
            present = await self.backend.exists_many([c.copy(FULL) for *_, c, _ in plan]) if plan else []
            loose = [i for i, p in enumerate(plan) if p[4] == LOOSE and not present[i]]
            for i, there in zip(loose, await self.backend.exists_many([plan[i][3].copy(LOOSE) for i in loose])):
                present[i] = there
            todo = [p for p, there in zip(plan, present) if not there]
            step = max(1, BATCH_BYTES // max((o.get_size() for _, o, *_ in todo), default=1))
            for b in range(0, len(todo), step):
                batch = todo[b : b + step]
                encoded = await asyncio.to_thread(self._encode, batch)
                await self.backend.put_many({m.payload_key: data for m, data in encoded})
                await self.backend.put_many({m.key: m.to_bytes(self._mac) for m, _ in encoded})  # manifests last
                nbytes += sum(len(d) for _, d in encoded)
                stored += [k for k, *_ in batch]
                sizes += [o.get_size() for _, o, *_ in batch]
        except FAULTS as e:
            logger.warning("lmcache L2 store of %d keys failed: %s: %s", len(keys), type(e).__name__, e)
            ok, faulted = False, True
            self.stats["faults"] += 1
        self.stats["stored" if ok else "store_failed"] += 1
        if stored:
            self._notify_keys_stored(stored, sizes)
        if self.compressor is not None and not faulted:
            for store, prefix in _longest(tips.values()):
                if len(prefix) <= self.settings.max_compress_tokens:
                    self._job(self._write_compressed(store, prefix))
        return L2StoreResult(ok, nbytes)

    def _encode(self, batch) -> list[tuple[Manifest, bytes]]:
        out = []
        for _, obj, store, c, copy in batch:  # DualCopyStore's own encoding: readers check it as theirs
            out.append(store.encode(c, copy, {"token_dim": 1}, to_layers(obj.tensor, self.head_dim), c.start, c.end))
        return out

    def _job(self, coro) -> None:
        task = self._loop.create_task(coro)
        self._jobs.add(task)
        task.add_done_callback(self._jobs.discard)

    async def _write_compressed(self, store: DualCopyStore, prefix: list[int]) -> None:
        """The compressed copy of a prefix whose full copy is stored: read back (checked), compress, write."""
        from ...compressors import PrefixKV

        try:
            if await store.has_compressed(prefix, self.compressor.spec):
                return
            layers = await store.get_full(prefix)
            kv = PrefixKV([k for k, _ in layers], [v for _, v in layers])
            comp = await asyncio.to_thread(self.compressor.compress, kv)
            await store.put_prefix(prefix, compressed={comp.spec: comp.to_payload()})
            self.stats["compressed"] += 1
        except Exception as e:  # noqa: BLE001 - the full copies stand; a reader compresses them itself
            logger.warning("lmcache L2: no compressed copy of %d tokens: %s: %s", len(prefix), type(e).__name__, e)

    # ---- lookup, load ------------------------------------------------------------------------------
    def _check(self, key, descs: dict) -> tuple[DualCopyStore, ChunkKey]:
        desc = descs.get(key.object_group_id)
        if desc is not None and list(desc.dtypes)[:1] != [self.dtype]:
            raise Unfit(f"layout {desc} is not of kv_dtype {self.dtype}")
        return self._base(key)

    async def _find(self, key, store: DualCopyStore, chunk: ChunkKey) -> Manifest | None:
        """The checked manifest of a chunk (full copy, else loose copy), or None."""
        for copy in (FULL, LOOSE):
            mkey = chunk.copy(copy)
            raw = await self.backend.get(mkey)
            if raw is not None:
                return self._parse(store, mkey, raw)
        return None

    def _parse(self, store: DualCopyStore, mkey: str, raw) -> Manifest | None:
        try:
            m = Manifest.from_bytes(raw, mkey, self._mac)
            want = (store.keys.model_name, store.keys.dtype_name)
            if (m.model, m.dtype) != want or m.copy not in (FULL, LOOSE):
                raise CorruptObject(f"a {m.copy} copy of {m.model}/{m.dtype}, not a chunk of {'/'.join(want)}")
            return m
        except CorruptObject as e:
            logger.warning("lmcache L2: %s is a miss: %s", mkey, e)
            return None

    async def _lookup(self, keys, descs) -> Bitmap:
        bitmap, named = Bitmap(len(keys)), []
        for i, key in enumerate(keys):
            try:
                named.append((i, key, *self._check(key, descs)))
            except ValueError as e:
                logger.warning("lmcache L2 lookup: %s is a miss: %s", key, e)
        try:
            if self._mac is None:  # presence, as DualCopyStore.lookup without a key
                found = await self.backend.exists_many([c.copy(FULL) for *_, c in named])
                rest = [j for j, hit in enumerate(found) if not hit]
                for j, hit in zip(rest, await self.backend.exists_many([named[j][3].copy(LOOSE) for j in rest])):
                    found[j] = hit
            else:
                found = await asyncio.gather(*(self._find(key, s, c) for _, key, s, c in named))
            for (i, *_), hit in zip(named, found):
                if hit:
                    bitmap.set(i)
        except FAULTS as e:
            logger.warning("lmcache L2 lookup of %d keys failed, all misses: %s: %s", len(keys), type(e).__name__, e)
            self.stats["faults"] += 1
        return bitmap

    async def _load(self, keys, objects) -> Bitmap:
        bitmap = Bitmap(len(keys))
        results = await asyncio.gather(*(self._load_one(k, o) for k, o in zip(keys, objects, strict=True)))
        hits = [k for k, ok in zip(keys, results) if ok]
        for i, ok in enumerate(results):
            if ok:
                bitmap.set(i)
        self.stats["hits"] += len(hits)
        self.stats["misses"] += len(keys) - len(hits)
        if hits:
            self._notify_keys_accessed(hits)
        return bitmap

    async def _load_one(self, key, obj) -> bool:
        try:
            n_layers, tokens, heads = kv_layout(obj, self.dtype, self.head_dim, self.settings.chunk_size)
            m = await self._find(key, *self._check(key, {}))
            if m is None:
                return False
            if m.num_tokens != tokens or len(m.layers) != n_layers:
                raise CorruptObject(
                    f"{m.key}: {m.num_tokens} tokens x {len(m.layers)} layers, buffer {tokens} x {n_layers}"
                )
            data = m.verify_payload(await self.backend.get_range(m.payload_key, 0, m.size + 1), self._mac)
            _, layers = await asyncio.to_thread(deserialize, data)
            token_dim, want, kv = m.meta.get("token_dim", 1), (heads, tokens, self.head_dim), []
            for i, layer in enumerate(layers):
                pair = [layer.get(name) for name in ("k", "v")]
                if not all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in pair):
                    raise CorruptObject(f"{m.key}: layer {i} lacks 3-d k/v tensors")
                pair = [t.movedim(token_dim, 1) for t in pair]
                if any(tuple(t.shape) != want or t.dtype != self.dtype for t in pair):
                    raise CorruptObject(f"{m.key}: layer {i} is {pair[0].dtype}{tuple(pair[0].shape)}, not {want}")
                kv.append(pair)
            fill(obj.tensor, kv)  # only once every layer passed
            return True
        except (*FAULTS, ValueError, IndexError, RuntimeError) as e:
            logger.warning("lmcache L2 load of %s is a miss: %s: %s", key, type(e).__name__, e)
            self.stats["faults"] += isinstance(e, FAULTS)
            return False


def _longest(prefixes) -> list[tuple[DualCopyStore, list[int]]]:
    """The prefixes (per store) that no other one in the list extends."""
    out: list[tuple[DualCopyStore, list[int]]] = []
    for store, prefix in sorted(prefixes, key=lambda sp: -len(sp[1])):
        if not any(s is store and p[: len(prefix)] == prefix for s, p in out):
            out.append((store, prefix))
    return out
