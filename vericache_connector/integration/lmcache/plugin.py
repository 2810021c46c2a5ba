"""LMCache 0.5.x remote-storage plugin that stores through our backends (LEGACY).

LMCache files in-process ``remote_storage_plugins`` under legacy (docs: legacy/migration_to_mp): current
deployments run ``lmcache server`` (multiprocess mode), whose storage tiers are L2 adapters; for that,
use vericache_connector/integration/lmcache/l2_adapter.py. This connector stays while LMCache still ships the API.

LMCache config (YAML or LMCacheEngineConfig)::

    remote_storage_plugins: ["vericache"]
    extra_config:
      remote_storage_plugin.vericache.module_path: vericache_connector.integration.lmcache.plugin
      remote_storage_plugin.vericache.class_name: VeriCacheRemoteConnector
      remote_storage_plugin.vericache.url: redis://127.0.0.1:6379/0   # any open_backend URL
      remote_storage_plugin.vericache.timeout_s: 5                     # optional
      remote_storage_plugin.vericache.model_dir: /models/SmolLM2-135M  # optional: model identity, below
      remote_storage_plugin.vericache.model_name: SmolLM2-135M         # optional: default model_dir's folder name
      remote_storage_plugin.vericache.mac_key_file: /run/secrets/vericache/mac-key   # optional

LMCache builds the connector with (loop, local_cpu_backend, config) only, so the
URL is found in extra_config under the plugin name whose class_name is ours
(else ``vericache.url``, else env VERICACHE_STORE_URL).

Model identity: LMCache's keys name the model by vLLM's model name, which two checkpoints
(runA/checkpoint, runB/checkpoint) or two revisions of one hub name can share. With ``model_dir``
the plugin replaces that name, in every key it stores or reads, with
``storage_backends.identity.dir_model_id(model_dir, kv_dtype, model_name)``: 'name.fingerprint' over
config, weights, tokenizer and KV dtype (LMCache's kv_dtype unless ``kv_dtype`` is set), the id the
engine and the vLLM connector use; ``model_id`` sets that id directly instead. Every object also
records the model it was written for: one whose record differs from the model its key names is a
miss with a warning.

Each chunk is one object: b"VCL2" | u32 header length | JSON header (model, shapes, dtypes, format,
length, and crc32 or, with a MAC key, a keyed BLAKE2b ``mac``, over the other header fields and the
raw bytes) | raw bytes. The MAC key comes from ``mac_key_file`` or env VERICACHE_MAC_KEY_FILE /
VERICACHE_MAC_KEY (credentials.secret_from_env); with a key, objects without a valid tag are misses,
and without one, objects written with a key are. An object that does not decode, check, or fit what
LMCache expects is a miss with a warning, as is any store fault: get returns None and LMCache
recomputes. Fitting means LMCache's own chunk layout (its metadata's shapes, dtypes and memory format):
as many tensors, each of the same rank and dims, only the token dim possibly shorter (a partial chunk),
and exactly the bytes those shapes need. A get reads at most a full chunk plus the header bound (a range
read), so a planted huge object is never read whole.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import struct
import zlib
from typing import List, Optional

from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from storage_backends.base import CorruptObject, StoreError, logger
from storage_backends.credentials import Mac, read_secret_file, redact_url, secret_from_env
from storage_backends.factory import open_backend
from storage_backends.lmcache_keys import resolve_model_id  # shared with the MP-mode L2 adapter

_MAGIC = b"VCL2"
_PREFIX = struct.Struct("<4sI")
_MAX_HEADER = 64 << 10  # a header names at most 8 shapes of 8 dims: well under this
MAC_ENV = "VERICACHE_MAC_KEY"


def resolve_plugin_options(config, cls_name: str) -> dict:
    """{'url': ..., other options} for this connector from an LMCache config."""
    extra = dict(getattr(config, "extra_config", None) or {})
    for name in getattr(config, "remote_storage_plugins", None) or []:
        if extra.get(f"remote_storage_plugin.{name}.class_name") == cls_name:
            head = f"remote_storage_plugin.{name}."
            opts = {k[len(head) :]: v for k, v in extra.items() if k.startswith(head)}
            opts.pop("module_path", None)
            opts.pop("class_name", None)
            if opts.get("url"):
                return opts
    url = extra.get("vericache.url") or os.environ.get("VERICACHE_STORE_URL")
    if not url:
        raise ValueError(
            "VeriCacheRemoteConnector needs a store URL: set extra_config "
            "'remote_storage_plugin.<name>.url' (or 'vericache.url', or env VERICACHE_STORE_URL)"
        )
    return {"url": url}


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name):
    import torch

    value = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(value, torch.dtype):
        raise CorruptObject(f"unknown dtype {name!r}")
    return value


def _canonical(fields: dict) -> bytes:
    return json.dumps(fields, separators=(",", ":"), sort_keys=True).encode()


def _is_shape(s) -> bool:
    return isinstance(s, list) and len(s) <= 8 and all(type(d) is int and 0 <= d < 1 << 40 for d in s)


class VeriCacheRemoteConnector(RemoteConnector):
    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend, config, **opts):
        metadata = local_cpu_backend.metadata
        super().__init__(local_cpu_backend.config, metadata)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        opts = {**resolve_plugin_options(config, type(self).__name__), **opts}
        self._store_url = opts.pop("url")
        self.url = redact_url(self._store_url)  # for messages; the backend gets the real one
        self.model_id = resolve_model_id(opts, getattr(metadata, "kv_dtype", None))
        key_file = opts.pop("mac_key_file", None)
        secret = read_secret_file(key_file, "MAC key") if key_file else secret_from_env(MAC_ENV, what="MAC key")
        self._mac = Mac(secret) if secret is not None else None
        self.backend_opts = opts
        self.sync_timeout_s = float(opts.get("timeout_s", 10.0)) * 2
        self._backend = None
        # LMCache's chunk layout (RemoteConnector.__init__ sets these from the model's metadata)
        self._shapes = [list(x) for x in getattr(self, "meta_shapes", None) or []]
        self._dtypes = list(getattr(self, "meta_dtypes", None) or [])
        self._fmt = getattr(self, "meta_fmt", None)
        self._max_bytes = getattr(self, "full_chunk_size_bytes", None)

    def _b(self):
        # Opened lazily, from a coroutine on LMCache's loop, so async clients bind to it.
        if self._backend is None:
            self._backend = open_backend(self._store_url, **self.backend_opts)
        return self._backend

    def __repr__(self) -> str:
        mac = " mac" if self._mac is not None else ""
        return f"<VeriCacheRemoteConnector {self.url} model={self.model_id or '(LMCache name)'}{mac}>"

    # -- keys ------------------------------------------------------------------------
    def _key(self, key) -> tuple[str, str]:
        """(key string stored under, the model it names)."""
        s = key.to_string()
        name = key.model_name
        if self.model_id is None or not s.startswith(f"{name}@"):
            return s, name
        return self.model_id + s[len(name) :], self.model_id

    # -- encoding -----------------------------------------------------------------
    @staticmethod
    def encode(memory_obj, model: str = "", mac: Mac | None = None) -> bytes:
        raw = bytes(memory_obj.byte_array)
        fields = {
            "model": model,
            "shapes": [list(s) for s in memory_obj.get_shapes()],
            "dtypes": [_dtype_name(d) for d in memory_obj.get_dtypes()],
            "fmt": int(memory_obj.get_memory_format().value),
            "length": len(raw),
        }
        head = _canonical(fields)
        if mac is not None:
            fields["mac"] = mac.tag(head, raw)
        else:
            fields["crc32"] = zlib.crc32(raw, zlib.crc32(head)) & 0xFFFFFFFF
        header = _canonical(fields)
        return _PREFIX.pack(_MAGIC, len(header)) + header + raw

    @staticmethod
    def decode(data: bytes, mac: Mac | None = None) -> tuple[dict, memoryview]:
        """(header, raw bytes) after every check that needs no LMCache state; CorruptObject otherwise."""
        if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) < _PREFIX.size:
            raise CorruptObject("object too short")
        magic, hlen = _PREFIX.unpack_from(data, 0)
        if magic != _MAGIC:
            raise CorruptObject(f"bad magic {magic!r}")
        if hlen > min(_MAX_HEADER, len(data) - _PREFIX.size):
            raise CorruptObject(f"header length {hlen} runs past the object ({len(data)} bytes)")
        try:
            header = json.loads(bytes(data[_PREFIX.size : _PREFIX.size + hlen]))
        except (ValueError, RecursionError) as e:
            raise CorruptObject(f"header does not parse: {type(e).__name__}") from None
        if not isinstance(header, dict):
            raise CorruptObject("header is not a JSON object")
        raw = memoryview(data)[_PREFIX.size + hlen :]
        shapes, dtypes = header.get("shapes"), header.get("dtypes")
        if not (
            isinstance(header.get("model"), str)
            and isinstance(shapes, list)
            and all(_is_shape(s) for s in shapes)
            and isinstance(dtypes, list)
            and all(isinstance(d, str) for d in dtypes)
            and len(shapes) == len(dtypes) > 0
            and type(header.get("fmt")) is int
            and type(header.get("length")) is int
        ):
            raise CorruptObject("header fields are missing or of the wrong type")
        if len(raw) != header["length"]:
            raise CorruptObject(f"truncated or grown: {len(raw)} bytes, header says {header['length']}")
        fields = {k: header[k] for k in ("model", "shapes", "dtypes", "fmt", "length")}
        if set(header) - set(fields) != ({"mac"} if mac is not None else {"crc32"}):
            raise CorruptObject("written with a MAC key, read without one" if mac is None else "no MAC")
        head = _canonical(fields)
        if mac is not None:
            if not mac.verify(header["mac"], head, raw):
                raise CorruptObject("MAC mismatch (written without the key, or tampered with)")
        elif zlib.crc32(raw, zlib.crc32(head)) & 0xFFFFFFFF != header["crc32"]:
            raise CorruptObject("crc32 mismatch")
        return header, raw

    def _check_fits(self, header: dict, raw: memoryview):
        """(shapes, dtypes, fmt) of a decoded object that LMCache may allocate; CorruptObject otherwise."""
        import torch
        from lmcache.v1.memory_management import MemoryFormat

        dtypes = [_dtype(d) for d in header["dtypes"]]
        if self._dtypes and dtypes != self._dtypes:
            raise CorruptObject(
                f"dtypes {header['dtypes']} are not this model's {[_dtype_name(d) for d in self._dtypes]}"
            )
        if self._shapes:
            self._check_shapes(header["shapes"])
        need = sum(math.prod(s) * d.itemsize for s, d in zip(header["shapes"], dtypes))
        if need != len(raw):
            raise CorruptObject(f"payload holds {len(raw)} bytes, its shapes need {need}")
        if self._max_bytes is not None and need > self._max_bytes:
            raise CorruptObject(f"{need} bytes, more than a full chunk ({self._max_bytes})")
        try:
            fmt = MemoryFormat(header["fmt"])
        except ValueError:
            raise CorruptObject(f"unknown memory format {header['fmt']!r}") from None
        if self._fmt is not None and fmt != self._fmt:
            raise CorruptObject(f"memory format {fmt.name} is not this model's {self._fmt.name}")
        return [torch.Size(s) for s in header["shapes"]], dtypes, fmt

    def _check_shapes(self, shapes: list) -> None:
        """The model's chunk layout: as many tensors, each of the same rank and dims as LMCache's full chunk,
        the token dim (2 of [2|1, layers, tokens, hidden]; 0 of a layerwise [tokens, ...]) in [1, full]."""
        if len(shapes) != len(self._shapes):
            raise CorruptObject(f"{len(shapes)} tensors, this model's chunks have {len(self._shapes)}")
        for got, full in zip(shapes, self._shapes):
            t = 2 if len(full) == 4 else 0
            ok = len(got) == len(full) and all(g == f for i, (g, f) in enumerate(zip(got, full)) if i != t)
            if not (ok and 1 <= got[t] <= full[t]):
                raise CorruptObject(f"shape {got} does not fit this model's chunk {full} (tokens on dim {t})")

    def _read_bound(self) -> int | None:
        """The most bytes an object of this model can have (None: LMCache gave no chunk size)."""
        return None if self._max_bytes is None else _PREFIX.size + _MAX_HEADER + self._max_bytes

    async def _read(self, key_str: str):
        """The object at key_str, at most _read_bound() + 1 bytes of it (a range read): a longer one is
        returned cut, and fails its length check as a miss."""
        bound = self._read_bound()
        if bound is None:
            return await self._b().get(key_str)
        return await self._b().get_range(key_str, 0, bound + 1)

    # -- RemoteConnector ----------------------------------------------------------------
    async def exists(self, key) -> bool:
        key_str, _ = self._key(key)
        try:
            return await self._b().exists(key_str)
        except StoreError as e:
            logger.warning("lmcache exists(%s) failed: %s", key_str, e)
            return False

    def exists_sync(self, key) -> bool:
        fut = asyncio.run_coroutine_threadsafe(self.exists(key), self.loop)
        return bool(fut.result(self.sync_timeout_s))

    def _to_memory_obj(self, key_str: str, model: str, data: Optional[bytes]):
        if data is None:
            return None
        try:
            bound = self._read_bound()
            if bound is not None and len(data) > bound:
                raise CorruptObject(f"object over {bound} bytes (a full chunk and its header), not read further")
            header, raw = self.decode(data, self._mac)
            if header["model"] != model:
                raise CorruptObject(f"written for model {header['model']!r}, not {model!r}")
            shapes, dtypes, fmt = self._check_fits(header, raw)
        except StoreError as e:
            logger.warning("lmcache object %s unusable, treated as a miss: %s", key_str, e)
            return None
        memory_obj = None
        try:
            memory_obj = self.local_cpu_backend.allocate(shapes, dtypes, fmt)
            if memory_obj is None:
                logger.warning("lmcache get %s: no local CPU memory to receive it", key_str)
                return None
            view = memory_obj.byte_array
            view = view if isinstance(view, memoryview) else memoryview(view)
            view = view.cast("B") if view.format != "B" else view
            if len(view) < len(raw):
                raise CorruptObject(f"{len(raw)} bytes do not fit the {len(view)} allocated")
            view[: len(raw)] = raw
            return memory_obj
        except Exception as e:  # LMCache's allocator on an object it does not expect: a miss, never an escape
            logger.warning("lmcache get %s: treated as a miss: %s: %s", key_str, type(e).__name__, e)
            if memory_obj is not None:
                memory_obj.ref_count_down()
            return None

    async def get(self, key):
        key_str, model = self._key(key)
        try:
            data = await self._read(key_str)
        except StoreError as e:
            logger.warning("lmcache get(%s) failed, treated as a miss: %s", key_str, e)
            return None
        return self._to_memory_obj(key_str, model, data)

    async def put(self, key, memory_obj) -> None:
        key_str, model = self._key(key)
        try:
            await self._b().put(key_str, self.encode(memory_obj, model, self._mac))
        except StoreError as e:
            logger.warning("lmcache put(%s) failed: %s", key_str, e)

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys, memory_objs) -> None:
        items = {}
        for k, m in zip(keys, memory_objs):
            key_str, model = self._key(k)
            items[key_str] = self.encode(m, model, self._mac)
        try:
            await self._b().put_many(items)
        except StoreError as e:
            logger.warning("lmcache batched_put of %d keys failed: %s", len(items), e)

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys):
        named = [self._key(k) for k in keys]
        try:
            values = await asyncio.gather(*(self._read(k) for k, _ in named))
        except StoreError as e:
            logger.warning("lmcache batched_get of %d keys failed: %s", len(keys), e)
            return [None] * len(keys)
        return [self._to_memory_obj(k, model, v) for (k, model), v in zip(named, values)]

    def remove_sync(self, key) -> bool:
        key_str, _ = self._key(key)

        async def delete():
            await self._b().delete(key_str)

        fut = asyncio.run_coroutine_threadsafe(delete(), self.loop)
        try:
            fut.result(self.sync_timeout_s)
            return True
        except Exception as e:
            logger.warning("lmcache remove(%s) failed: %s", key_str, e)
            return False

    async def list(self) -> List[str]:
        keys = getattr(self._b(), "keys", None)
        return list(keys()) if callable(keys) else []

    async def close(self) -> None:
        backend, self._backend = self._backend, None
        if backend is not None:
            try:  # never let a dead store hang LMCache's shutdown
                await asyncio.wait_for(backend.close(), self.sync_timeout_s)
            except Exception as e:
                logger.warning("lmcache connector close: %s", e)
