"""LMCache 0.5.x remote-storage plugin that stores through our backends.

LMCache config (YAML or LMCacheEngineConfig)::

    remote_storage_plugins: ["vericache"]
    extra_config:
      remote_storage_plugin.vericache.module_path: storage_backends.lmcache_plugin
      remote_storage_plugin.vericache.class_name: VeriCacheRemoteConnector
      remote_storage_plugin.vericache.url: redis://127.0.0.1:6379/0   # any open_backend URL
      remote_storage_plugin.vericache.timeout_s: 5                     # optional

LMCache builds the connector with (loop, local_cpu_backend, config) only, so the
URL is found in extra_config under the plugin name whose class_name is ours
(else ``vericache.url``, else env VERICACHE_STORE_URL). Each chunk is one object
under LMCache's own key string: b"VCLM" | u32 header length | JSON header
(shapes, dtypes, format, length, crc32) | raw bytes. Store faults are logged
and reported to LMCache as a miss (get -> None) so it recomputes.
"""

from __future__ import annotations

import asyncio
import json
import os
import struct
import zlib
from typing import List, Optional

from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from .base import StoreError, logger, open_backend

_MAGIC = b"VCLM"
_PREFIX = struct.Struct("<4sI")


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


def _dtype(name: str):
    import torch

    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return value


class VeriCacheRemoteConnector(RemoteConnector):
    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend, config, **opts):
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        opts = {**resolve_plugin_options(config, type(self).__name__), **opts}
        self.url = opts.pop("url")
        self.backend_opts = opts
        self.sync_timeout_s = float(opts.get("timeout_s", 10.0)) * 2
        self._backend = None

    def _b(self):
        # Opened lazily, from a coroutine on LMCache's loop, so async clients bind to it.
        if self._backend is None:
            self._backend = open_backend(self.url, **self.backend_opts)
        return self._backend

    def __repr__(self) -> str:
        return f"<VeriCacheRemoteConnector {self.url}>"

    # -- encoding -----------------------------------------------------------------
    @staticmethod
    def encode(memory_obj) -> bytes:
        raw = bytes(memory_obj.byte_array)
        header = json.dumps(
            {
                "shapes": [list(s) for s in memory_obj.get_shapes()],
                "dtypes": [_dtype_name(d) for d in memory_obj.get_dtypes()],
                "fmt": int(memory_obj.get_memory_format().value),
                "length": len(raw),
                "crc32": zlib.crc32(raw) & 0xFFFFFFFF,
            },
            separators=(",", ":"),
        ).encode()
        return _PREFIX.pack(_MAGIC, len(header)) + header + raw

    @staticmethod
    def decode(data: bytes) -> tuple[dict, memoryview]:
        from .base import CorruptObject

        if len(data) < _PREFIX.size:
            raise CorruptObject(f"object too short ({len(data)} bytes)")
        magic, hlen = _PREFIX.unpack_from(data, 0)
        if magic != _MAGIC:
            raise CorruptObject(f"bad magic {magic!r}")
        try:
            header = json.loads(bytes(data[_PREFIX.size : _PREFIX.size + hlen]))
        except ValueError as e:
            raise CorruptObject(f"header does not parse: {e}") from e
        raw = memoryview(data)[_PREFIX.size + hlen :]
        if len(raw) != header.get("length"):
            raise CorruptObject(f"truncated: {len(raw)} bytes, header says {header.get('length')}")
        if zlib.crc32(raw) & 0xFFFFFFFF != header.get("crc32"):
            raise CorruptObject("crc32 mismatch")
        return header, raw

    # -- RemoteConnector ----------------------------------------------------------------
    async def exists(self, key) -> bool:
        try:
            return await self._b().exists(key.to_string())
        except StoreError as e:
            logger.warning("lmcache exists(%s) failed: %s", key.to_string(), e)
            return False

    def exists_sync(self, key) -> bool:
        fut = asyncio.run_coroutine_threadsafe(self.exists(key), self.loop)
        return bool(fut.result(self.sync_timeout_s))

    def _to_memory_obj(self, key_str: str, data: Optional[bytes]):
        import torch
        from lmcache.v1.memory_management import MemoryFormat

        if data is None:
            return None
        try:
            header, raw = self.decode(data)
        except StoreError as e:
            logger.warning("lmcache object %s unusable, treated as a miss: %s", key_str, e)
            return None
        shapes = [torch.Size(s) for s in header["shapes"]]
        dtypes = [_dtype(d) for d in header["dtypes"]]
        memory_obj = self.local_cpu_backend.allocate(shapes, dtypes, MemoryFormat(header["fmt"]))
        if memory_obj is None:
            logger.warning("lmcache get %s: no local CPU memory to receive it", key_str)
            return None
        view = memory_obj.byte_array
        view = view if isinstance(view, memoryview) else memoryview(view)
        view = view.cast("B") if view.format != "B" else view
        if len(view) < len(raw):
            logger.warning("lmcache get %s: %d bytes do not fit %d", key_str, len(raw), len(view))
            memory_obj.ref_count_down()
            return None
        view[: len(raw)] = raw
        return memory_obj

    async def get(self, key):
        key_str = key.to_string()
        try:
            data = await self._b().get(key_str)
        except StoreError as e:
            logger.warning("lmcache get(%s) failed, treated as a miss: %s", key_str, e)
            return None
        return self._to_memory_obj(key_str, data)

    async def put(self, key, memory_obj) -> None:
        try:
            await self._b().put(key.to_string(), self.encode(memory_obj))
        except StoreError as e:
            logger.warning("lmcache put(%s) failed: %s", key.to_string(), e)

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys, memory_objs) -> None:
        items = {k.to_string(): self.encode(m) for k, m in zip(keys, memory_objs)}
        try:
            await self._b().put_many(items)
        except StoreError as e:
            logger.warning("lmcache batched_put of %d keys failed: %s", len(items), e)

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys):
        key_strs = [k.to_string() for k in keys]
        try:
            values = await self._b().get_many(key_strs)
        except StoreError as e:
            logger.warning("lmcache batched_get of %d keys failed: %s", len(keys), e)
            return [None] * len(keys)
        return [self._to_memory_obj(k, v) for k, v in zip(key_strs, values)]

    def remove_sync(self, key) -> bool:
        async def delete():
            await self._b().delete(key.to_string())

        fut = asyncio.run_coroutine_threadsafe(delete(), self.loop)
        try:
            fut.result(self.sync_timeout_s)
            return True
        except Exception as e:
            logger.warning("lmcache remove(%s) failed: %s", key.to_string(), e)
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
