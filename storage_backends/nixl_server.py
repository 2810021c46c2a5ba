"""A small NIXL key/value server: one registered DRAM arena + a TCP control channel.

Clients (nixl_connector.NixlBackend) ask over TCP for room or for an object's
place in the arena, then move the bytes themselves with one-sided NIXL
WRITE/READ transfers; an object becomes visible only on ``commit`` (after its
bytes landed), and replaces an older value atomically. When the arena is full
the least recently committed objects not being read are evicted.

Control channel: frames of u32 length + JSON, at most MAX_FRAME bytes (UNAUTH_FRAME before a client
has authenticated); a longer frame closes the connection before its body is read. The server opens
with a greeting holding a nonce. With a token (``token=``, or env VERICACHE_NIXL_TOKEN_FILE /
VERICACHE_NIXL_TOKEN for the standalone server: never argv) the client's first request, ``hello``,
must carry a keyed BLAKE2b tag over both nonces, and the server proves the token back; a connection
that fails is closed, and no other request is served before it succeeds.

Run standalone: ``VERICACHE_NIXL_TOKEN_FILE=/run/secrets/nixl-token python -m storage_backends.nixl_server
--port 5555 --capacity-mb 512`` (or ``--no-token`` on a trusted network).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import json
import logging
import os
import struct
import threading
import uuid
from collections import OrderedDict

from .credentials import Mac, secret_from_env

logger = logging.getLogger("vericache.store")
_FRAME = struct.Struct("<I")
_ALIGN = 64
MAX_FRAME = 4 << 20  # bytes of one control message (an exists of ~10k keys fits)
UNAUTH_FRAME = 4 << 10  # before the client has authenticated
HELLO_TIMEOUT_S = 30.0
PROTOCOL = "vericache-nixl/2"
TOKEN_ENV = "VERICACHE_NIXL_TOKEN"  # or VERICACHE_NIXL_TOKEN_FILE: the path of a mounted Secret
TOKEN_PERSON = b"vericache-nixl"


class FrameError(ValueError):
    """A control frame that is too long, nests too deeply or is not a JSON object."""


async def read_frame(reader: asyncio.StreamReader, limit: int = MAX_FRAME) -> dict:
    (n,) = _FRAME.unpack(await reader.readexactly(_FRAME.size))
    if n > limit:
        raise FrameError(f"control frame of {n} bytes, limit {limit}")
    body = await reader.readexactly(n)
    try:
        msg = json.loads(body)
    except RecursionError:  # deeply nested JSON: a bad frame like any other, not a traceback in the log
        raise FrameError(f"control frame of {n} bytes nests too deeply") from None
    if not isinstance(msg, dict):
        raise FrameError(f"control frame is a JSON {type(msg).__name__}, not an object")
    return msg


def frame(msg: dict, limit: int = MAX_FRAME) -> bytes:
    body = json.dumps(msg, separators=(",", ":")).encode()
    if len(body) > limit:
        raise FrameError(f"control frame of {len(body)} bytes, limit {limit}")
    return _FRAME.pack(len(body)) + body


def auth_tag(mac: Mac, side: str, server_nonce: str, client_nonce: str) -> str:
    """What each side sends to prove it holds the token: bound to its role and both nonces."""
    return mac.tag(side.encode(), str(server_nonce).encode(), str(client_nonce).encode())


class Arena:
    """First-fit allocator over [0, capacity) with coalescing free list."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.free: list[tuple[int, int]] = [(0, capacity)]  # sorted (offset, size)

    def alloc(self, size: int) -> int | None:
        size = max(_ALIGN, -(-size // _ALIGN) * _ALIGN)
        for i, (off, n) in enumerate(self.free):
            if n >= size:
                self.free[i : i + 1] = [(off + size, n - size)] if n > size else []
                return off
        return None

    def release(self, off: int, size: int) -> None:
        size = max(_ALIGN, -(-size // _ALIGN) * _ALIGN)
        self.free.append((off, size))
        self.free.sort()
        merged: list[tuple[int, int]] = []
        for o, n in self.free:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((o, n))
        self.free = merged


class NixlStoreServer:
    """token: a shared secret (>= 16 bytes) every client must prove it holds; None serves anyone who
    can connect (loopback / a trusted network only)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        capacity_bytes: int = 256 << 20,
        backend: str = "UCX",
        token: bytes | str | None = None,
    ):
        self.host, self.port = host, port
        self._mac = Mac(token, TOKEN_PERSON) if token is not None else None
        self.capacity = int(capacity_bytes)
        self.backend = backend
        self.objects: OrderedDict[str, tuple[int, int]] = OrderedDict()  # key -> (offset, size)
        self.leases: dict[int, tuple[int, int]] = {}
        self.readers: dict[int, int] = {}  # offset -> active leases
        self.doomed: dict[int, int] = {}  # offset -> size, freed when no longer read
        self._lease_ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None

    @property
    def url(self) -> str:
        return f"nixl://{self.host}:{self.port}"

    def _setup_nixl(self) -> None:
        import torch
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = f"vc-nixl-store-{uuid.uuid4().hex[:8]}"
        self.agent = nixl_agent(self.name, nixl_agent_config(backends=[self.backend]))
        self.buf = torch.zeros(self.capacity, dtype=torch.uint8)
        self.reg = self.agent.register_memory(self.buf)
        self.arena = Arena(self.capacity)

    # -- lifecycle -------------------------------------------------------------
    def start(self) -> "NixlStoreServer":
        """Serve from a daemon thread; returns once listening (self.port is set)."""
        self._setup_nixl()
        ready = threading.Event()
        errors: list[BaseException] = []

        def run():
            self._loop = asyncio.new_event_loop()
            try:
                self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, self.host, self.port))
                self.port = self._server.sockets[0].getsockname()[1]
            except BaseException as e:  # report bind errors to start()
                errors.append(e)
                ready.set()
                return
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="nixl-store-server", daemon=True)
        self._thread.start()
        ready.wait(30)
        if errors:
            raise errors[0]
        logger.info("NIXL store %s serving %d bytes on %s", self.name, self.capacity, self.url)
        return self

    def stop(self) -> None:
        loop = self._loop
        if loop is None:
            return

        async def shutdown():
            self._server.close()
            for task in [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]:
                task.cancel()

        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(10)
        self._loop = None
        try:
            self.agent.deregister_memory(self.reg)
        except Exception as e:
            logger.debug("nixl deregister: %s", e)

    def __enter__(self) -> "NixlStoreServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- object table ------------------------------------------------------------
    def _free(self, off: int, size: int) -> None:
        if self.readers.get(off):
            self.doomed[off] = size
        else:
            self.arena.release(off, size)

    def _alloc(self, size: int) -> int | None:
        off = self.arena.alloc(size)
        while off is None:
            victim = next((k for k, (o, _) in self.objects.items() if not self.readers.get(o)), None)
            if victim is None:
                return None
            self._free(*self.objects.pop(victim))
            off = self.arena.alloc(size)
        return off

    def _release_lease(self, lease: int) -> None:
        if lease not in self.leases:
            return
        off, size = self.leases.pop(lease)
        self.readers[off] -= 1
        if not self.readers[off]:
            del self.readers[off]
            if off in self.doomed:
                self.arena.release(off, self.doomed.pop(off))

    def _hello(self, req: dict, conn: "_Conn") -> dict:
        reply = {}
        if self._mac is not None:
            nonce = req.get("nonce")
            if not isinstance(nonce, str) or not self._mac.verify(
                req.get("auth"), b"client", conn.nonce.encode(), nonce.encode()
            ):
                conn.closing = True
                return {"error": "authentication failed"}
            reply["auth"] = auth_tag(self._mac, "server", conn.nonce, nonce)
        conn.authed = True
        return {
            **reply,
            "agent": self.name,
            "meta": base64.b64encode(self.agent.get_agent_metadata()).decode(),
            "base": self.buf.data_ptr(),
            "capacity": self.capacity,
        }

    def handle(self, req: dict, conn: "_Conn") -> dict:
        op = req.get("op")
        if op == "hello":
            return self._hello(req, conn)
        if not conn.authed:
            conn.closing = True
            return {"error": "authentication required: send hello first"}
        if op == "alloc":
            size = int(req["size"])
            off = self._alloc(size) if 0 <= size <= self.capacity else None
            if off is None:
                return {"error": f"no room for {size} bytes (capacity {self.capacity})"}
            conn.allocs[off] = size
            return {"offset": off}
        if op == "abort":
            off = int(req["offset"])
            if off in conn.allocs:
                self.arena.release(off, conn.allocs.pop(off))
            return {}
        if op == "commit":
            off, size = int(req["offset"]), int(req["size"])
            if conn.allocs.get(off) != size:
                return {"error": f"commit of {req['key']!r}: no pending allocation at {off} of {size} bytes"}
            del conn.allocs[off]
            old = self.objects.pop(req["key"], None)
            self.objects[req["key"]] = (off, size)
            if old is not None:
                self._free(*old)
            return {}
        if op == "lookup":
            hit = self.objects.get(req["key"])
            if hit is None:
                return {"found": False}
            lease = next(self._lease_ids)
            self.leases[lease] = hit
            self.readers[hit[0]] = self.readers.get(hit[0], 0) + 1
            conn.leases.add(lease)
            return {"found": True, "offset": hit[0], "size": hit[1], "lease": lease}
        if op == "release":
            if req["lease"] in conn.leases:  # only this connection's own leases
                conn.leases.discard(req["lease"])
                self._release_lease(req["lease"])
            return {}
        if op == "exists":
            return {"found": [k in self.objects for k in req["keys"]]}
        if op == "delete":
            old = self.objects.pop(req["key"], None)
            if old is not None:
                self._free(*old)
            return {}
        return {"error": f"unknown op {op!r}"}

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn()
        try:
            writer.write(frame({"protocol": PROTOCOL, "nonce": conn.nonce, "auth": self._mac is not None}))
            await writer.drain()
            while not conn.closing:
                if conn.authed:
                    req = await read_frame(reader, MAX_FRAME)
                else:
                    req = await asyncio.wait_for(read_frame(reader, UNAUTH_FRAME), HELLO_TIMEOUT_S)
                try:
                    resp = self.handle(req, conn)
                except (KeyError, TypeError, ValueError, OverflowError) as e:  # int(1e999) is an OverflowError
                    resp = {"error": f"bad request: {type(e).__name__}: {e}"}
                writer.write(frame(resp))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError, asyncio.TimeoutError):
            pass
        except ValueError as e:  # FrameError, JSON that does not parse: drop the client, keep serving
            logger.warning("nixl store: closing a connection: %s: %s", type(e).__name__, e)
        finally:  # a client that went away keeps nothing pinned or half-written
            for lease in conn.leases:
                self._release_lease(lease)
            for off, size in conn.allocs.items():
                self.arena.release(off, size)
            writer.close()


class _Conn:
    def __init__(self):
        self.leases: set[int] = set()
        self.allocs: dict[int, int] = {}
        self.nonce = os.urandom(16).hex()
        self.authed = False
        self.closing = False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--capacity-mb", type=int, default=256)
    ap.add_argument("--backend", default="UCX")
    ap.add_argument(
        "--no-token", action="store_true", help=f"serve without {TOKEN_ENV}(_FILE) (a trusted network only)"
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    token = secret_from_env(TOKEN_ENV, what="NIXL token")
    if token is None and not args.no_token:
        ap.error(f"set {TOKEN_ENV}_FILE (a mounted secret file) or {TOKEN_ENV}, or pass --no-token")
    server = NixlStoreServer(args.host, args.port, args.capacity_mb << 20, args.backend, token=token).start()
    print(server.url, flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    main()
