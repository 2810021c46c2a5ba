"""nixl://host:port store: a NixlStoreServer (nixl_server.py) reached with NIXL transfers.

Control messages go over TCP; the bytes move by one-sided NIXL WRITE/READ
between a registered staging buffer here and the server's registered DRAM
arena (UCX by default; DRAM to DRAM works without CUDA). Replies are bounded
(nixl_server.MAX_FRAME) and checked; a size the server reports is checked
against the read's range (or max_object_bytes) before any staging or transfer.
"""

from __future__ import annotations

import asyncio
import base64
import os
import time
import uuid

from .base import (
    BackendOptions,
    CorruptObject,
    StorageBackend,
    StoreUnavailable,
    check_range,
    logger,
    query_options,
    redact_url,
    split_url,
    unknown_options,
)
from .credentials import Mac, read_secret_file, secret_from_env
from .nixl_server import PROTOCOL, TOKEN_ENV, TOKEN_PERSON, auth_tag, frame, read_frame


class NixlBackend(StorageBackend):
    """Options (kwargs or URL query): timeout_s, connect_timeout_s, backend (UCX),
    prefix (prepended to every key), max_object_bytes (default 1 GiB: a whole-object get of
    anything bigger is CorruptObject, before any transfer), token_file (the path of the server's
    token). The token itself: keyword ``token`` (never in the URL), else token_file, else env
    VERICACHE_NIXL_TOKEN_FILE / VERICACHE_NIXL_TOKEN. With a token, the server must prove it too."""

    def __init__(self, url: str, **opts):
        shown = redact_url(url)
        parts = split_url(url)
        try:
            port = parts.port
        except ValueError:
            port = None
        if not parts.hostname or not port or "@" in parts.netloc:
            raise ValueError(f"bad store URL {shown!r}: expected nixl://host:port")
        query = query_options(url)
        if "token" in query:
            raise ValueError(f"store URL {shown!r} holds a token: pass token_file, or set {TOKEN_ENV}_FILE")
        opts = {**query, **opts}
        self.options = BackendOptions.pop_from(opts)
        self.nixl_backend = str(opts.pop("backend", "UCX"))
        self.prefix = str(opts.pop("prefix", ""))
        self.max_object_bytes = int(opts.pop("max_object_bytes", 1 << 30))
        token, token_file = opts.pop("token", None), opts.pop("token_file", None)
        if opts:
            raise unknown_options(opts, url)
        if token is None:
            token = read_secret_file(token_file, "NIXL token") if token_file else secret_from_env(TOKEN_ENV)
        self._mac = Mac(token, TOKEN_PERSON) if token is not None else None
        self.url, self.host, self.port = shown, parts.hostname, port
        self._lock: asyncio.Lock | None = None
        self._reader = self._writer = None
        self._agent = None
        self._stage = None
        self._stage_reg = None

    # -- connection ----------------------------------------------------------------
    async def _connect(self) -> None:
        if self._writer is not None:
            return
        try:
            self._reader, self._writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port), self.options.connect_timeout_s
            )
        except (OSError, asyncio.TimeoutError) as e:
            raise StoreUnavailable(f"{self.url}: cannot connect: {type(e).__name__}: {e}") from e
        try:
            await self._handshake()
        except BaseException:
            self._drop()  # a half-open connection is never reused
            raise

    async def _handshake(self) -> None:
        greeting = await self._recv("greeting")
        if greeting.get("protocol") != PROTOCOL or not isinstance(greeting.get("nonce"), str):
            raise StoreUnavailable(f"{self.url}: not a {PROTOCOL} store")
        hello_msg = {"op": "hello"}
        if self._mac is not None:
            nonce = os.urandom(16).hex()
            hello_msg.update(nonce=nonce, auth=auth_tag(self._mac, "client", greeting["nonce"], nonce))
        elif greeting.get("auth"):
            raise StoreUnavailable(f"{self.url}: the store wants a token: set {TOKEN_ENV}_FILE or token_file")
        hello = await self._rpc(hello_msg)
        if self._mac is not None and not self._mac.verify(
            hello.get("auth"), b"server", greeting["nonce"].encode(), hello_msg["nonce"].encode()
        ):
            raise StoreUnavailable(f"{self.url}: the store did not prove it holds the token")
        if self._agent is None:
            from nixl._api import nixl_agent, nixl_agent_config

            self._agent = nixl_agent(
                f"vc-nixl-client-{uuid.uuid4().hex[:8]}", nixl_agent_config(backends=[self.nixl_backend])
            )
        try:
            self._remote = self._agent.add_remote_agent(base64.b64decode(hello["meta"]))
            self._base = int(hello["base"])
        except Exception as e:  # nixl binding errors on metadata that does not parse
            raise StoreUnavailable(f"{self.url}: bad agent metadata from the store: {type(e).__name__}") from e

    async def _recv(self, what: str) -> dict:
        try:
            return await asyncio.wait_for(read_frame(self._reader), self.options.timeout_s)
        except (OSError, EOFError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError) as e:
            self._drop()
            raise StoreUnavailable(f"{self.url}: {what} failed: {type(e).__name__}: {e}") from e

    async def _rpc(self, msg: dict) -> dict:
        try:
            self._writer.write(frame(msg))
            await asyncio.wait_for(self._writer.drain(), self.options.timeout_s)
        except (OSError, asyncio.TimeoutError, ValueError) as e:
            self._drop()
            raise StoreUnavailable(f"{self.url}: {msg.get('op')} failed: {type(e).__name__}: {e}") from e
        resp = await self._recv(str(msg.get("op")))
        if "error" in resp:
            raise StoreUnavailable(f"{self.url}: {msg.get('op')}: {str(resp['error'])[:500]}")
        return resp

    def _drop(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None

    def _staging(self, n: int):
        import torch

        if self._stage is None or self._stage.numel() < n:
            if self._stage_reg is not None:
                self._agent.deregister_memory(self._stage_reg)
            size = 1 << max(23, (n - 1).bit_length())  # >= 8 MiB, power of two
            self._stage = torch.empty(size, dtype=torch.uint8)
            self._stage_reg = self._agent.register_memory(self._stage)
        return self._stage

    async def _xfer(self, op: str, remote_offset: int, n: int) -> None:
        agent = self._agent
        local = agent.get_xfer_descs([(self._stage.data_ptr(), n, 0)], "DRAM")
        remote = agent.get_xfer_descs([(self._base + remote_offset, n, 0)], "DRAM")
        try:
            handle = agent.initialize_xfer(op, local, remote, self._remote)
        except Exception as e:  # nixl binding errors
            raise StoreUnavailable(f"{self.url}: NIXL {op} setup failed: {type(e).__name__}: {e}") from e
        try:
            state = agent.transfer(handle)
            deadline = time.monotonic() + self.options.timeout_s
            delay = 0.0
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise StoreUnavailable(f"{self.url}: NIXL {op} of {n} bytes timed out")
                await asyncio.sleep(delay)
                delay = min(0.005, delay * 2 or 0.0002)
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise StoreUnavailable(f"{self.url}: NIXL {op} of {n} bytes failed ({state})")
        finally:
            handle.release()

    async def _op(self, fn, *args):
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            try:
                await self._connect()
                return await fn(*args)
            except (StoreUnavailable, CorruptObject) as e:
                logger.warning("nixl: %s", e)
                raise
            except (KeyError, TypeError, ValueError) as e:  # a reply off the protocol
                self._drop()
                msg = f"{self.url}: bad reply from the store: {type(e).__name__}: {e}"
                logger.warning("nixl: %s", msg)
                raise StoreUnavailable(msg) from e

    # -- StorageBackend ------------------------------------------------------------------
    async def put(self, key: str, data: bytes) -> None:
        await self._op(self._put, self.prefix + key, data)

    async def _put(self, key: str, data: bytes) -> None:
        import numpy as np

        n = len(data)
        off = (await self._rpc({"op": "alloc", "size": n}))["offset"]
        try:
            if n:
                self._staging(n)[:n].numpy()[:] = np.frombuffer(data, dtype=np.uint8)
                await self._xfer("WRITE", off, n)
        except BaseException:
            if self._writer is not None:
                await self._rpc({"op": "abort", "offset": off})
            raise
        await self._rpc({"op": "commit", "key": key, "offset": off, "size": n})

    async def _read(self, key: str, start: int, end: int | None) -> bytes | None:
        hit = await self._rpc({"op": "lookup", "key": key})
        if not hit["found"]:
            return None
        try:
            size, offset = hit["size"], hit["offset"]
            if not (isinstance(size, int) and isinstance(offset, int) and size >= 0 and offset >= 0):
                raise StoreUnavailable(f"{self.url}: lookup of {key!r}: bad reply {hit!r}")
            if end is None and size > self.max_object_bytes:  # before any staging or transfer
                raise CorruptObject(f"{self.url}: object {key!r} is {size} bytes, over max_object_bytes")
            stop = size if end is None else min(end, size)
            n = max(0, stop - start)
            if n == 0:
                return b""
            stage = self._staging(n)
            await self._xfer("READ", offset + start, n)
            return stage[:n].numpy().tobytes()
        finally:
            if self._writer is not None:
                await self._rpc({"op": "release", "lease": hit["lease"]})

    async def get(self, key: str) -> bytes | None:
        return await self._op(self._read, self.prefix + key, 0, None)

    async def get_range(self, key: str, start: int, end: int) -> bytes | None:
        check_range(start, end)
        return await self._op(self._read, self.prefix + key, start, end)

    async def exists(self, key: str) -> bool:
        return (await self.exists_many([key]))[0]

    async def exists_many(self, keys) -> list[bool]:
        keys = [self.prefix + k for k in keys]

        async def run():
            found = (await self._rpc({"op": "exists", "keys": keys}))["found"]
            if not isinstance(found, list) or len(found) != len(keys):
                raise StoreUnavailable(f"{self.url}: exists: bad reply for {len(keys)} keys")
            return [bool(x) for x in found]

        return await self._op(run)

    async def delete(self, key: str) -> None:
        async def run():
            await self._rpc({"op": "delete", "key": self.prefix + key})

        await self._op(run)

    async def close(self) -> None:
        self._drop()
        if self._agent is not None:
            try:
                if self._stage_reg is not None:
                    self._agent.deregister_memory(self._stage_reg)
                if getattr(self, "_remote", None):
                    self._agent.remove_remote_agent(self._remote)
            except Exception as e:
                logger.debug("nixl close: %s", e)
            self._stage_reg = self._stage = None
