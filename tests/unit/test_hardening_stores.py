"""Issue 28, case 9, on the storage side: a pre-auth NIXL control frame of deeply nested JSON (an
unhandled RecursionError traceback before: now a bad frame, the connection closed, the server serving
on), and a reader without the MAC key, which counted keyed entries as present in lookup (now it counts
only what it can load). In-memory store; the NIXL control channel without NIXL itself."""

from __future__ import annotations

import asyncio
import json
import logging
import struct

import pytest
import torch

from storage_backends import DualCopyStore, open_backend
from storage_backends.nixl_server import UNAUTH_FRAME, NixlStoreServer

from stores import random_kv, random_tokens, run

MODEL, KEY = "m.0123456789abcdef", b"k" * 32
SPEC = "kivi:bits=4,group=32"


async def _nested_frame_then_a_greeting(server: NixlStoreServer) -> tuple[bytes, dict]:
    """Send a pre-auth frame of nested JSON; (what the server sent after it, the next client's greeting)."""
    listener = await asyncio.start_server(server._serve, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        (n,) = struct.unpack("<I", await reader.readexactly(4))
        json.loads(await reader.readexactly(n))  # the greeting
        body = b"[" * (UNAUTH_FRAME - 1)  # fits the pre-auth bound, nests ~4000 deep
        writer.write(struct.pack("<I", len(body)) + body)
        await writer.drain()
        rest = await asyncio.wait_for(reader.read(), 10)  # b"": closed without an answer
        writer.close()
        reader2, writer2 = await asyncio.open_connection("127.0.0.1", port)
        (n,) = struct.unpack("<I", await reader2.readexactly(4))
        greeting = json.loads(await reader2.readexactly(n))
        writer2.close()
        await asyncio.sleep(0.05)
        return rest, greeting
    finally:
        listener.close()
        await listener.wait_closed()


def test_nested_json_before_auth_is_a_bad_frame_not_a_traceback(caplog):
    server = NixlStoreServer(token=b"t" * 32)  # the control channel only: no NIXL agent is made
    errors = []

    async def go():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))
        return await _nested_frame_then_a_greeting(server)

    with caplog.at_level(logging.WARNING):
        rest, greeting = asyncio.run(go())
    assert rest == b"" and greeting["auth"] is True  # dropped, and the next client is served
    assert not errors, errors  # nothing escaped to asyncio's handler
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert any("nests too deeply" in r.getMessage() for r in caplog.records)


def _copies():
    tokens = random_tokens(300)
    kv = random_kv(2, 2, 300, 8, torch.float16)
    g = torch.Generator().manual_seed(1)
    comp = {SPEC: ({"keep": 1}, [{"k": torch.randn(2, 75, 8, generator=g).half()} for _ in range(2)])}
    return tokens, kv, comp


def test_a_reader_without_the_key_does_not_count_keyed_entries(memory_url):
    tokens, kv, comp = _copies()

    async def go():
        async with DualCopyStore(memory_url, MODEL, torch.float16, mac_key=KEY) as w:
            await w.put_prefix(tokens, kv, comp)
            keyed = (await w.lookup(tokens), await w.has_compressed(tokens, SPEC))
        async with DualCopyStore(memory_url, MODEL, torch.float16) as r:
            plain = (await r.lookup(tokens), await r.has_compressed(tokens, SPEC))
            assert await r.get_compressed(tokens, SPEC) is None  # what it could not load anyway
            await r.put_prefix(tokens, kv)  # and it does not overwrite the keyed writer's entries
        async with DualCopyStore(memory_url, MODEL, torch.float16, mac_key=KEY) as w:
            return keyed, plain, await w.lookup(tokens)

    keyed, plain, after = run(go())
    assert keyed == (300, True) and plain == (0, False) and after == 300


def test_a_corrupt_full_manifest_is_a_miss_and_the_next_write_repairs_it(memory_url):
    tokens, kv, _ = _copies()

    async def go():
        async with DualCopyStore(memory_url, MODEL, torch.float16) as s:
            await s.put_prefix(tokens, kv)
            key = s.keys.chunks(tokens)[0].copy("full")
            backend = open_backend(memory_url)
            data = bytearray(await backend.get(key))
            data[-3] ^= 0xFF
            await backend.put(key, bytes(data))
            broken = await s.lookup(tokens)
            await s.put_prefix(tokens, kv)  # what a miss writes (no overwrite)
            return broken, await s.lookup(tokens), await s.get_full(tokens)

    broken, repaired, got = run(go())
    assert (broken, repaired) == (0, 300)
    assert all(torch.equal(k, x["k"]) and torch.equal(v, x["v"]) for (k, v), x in zip(got, kv))


def test_read_frame_turns_deep_nesting_into_a_frame_error():
    """The client side reads the server's frames with the same function (a store that answers so)."""
    from storage_backends.nixl_server import MAX_FRAME, FrameError, read_frame

    async def go():
        reader = asyncio.StreamReader()
        body = b'{"a":' * 50_000
        reader.feed_data(struct.pack("<I", len(body)) + body)
        reader.feed_eof()
        with pytest.raises(FrameError, match="nests too deeply"):
            await read_frame(reader, MAX_FRAME)

    asyncio.run(go())
