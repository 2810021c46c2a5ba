"""The NIXL store's control channel on loopback: bounded frames, a token (from a file or the environment,
never argv) that both sides prove, and sizes checked before any transfer."""

from __future__ import annotations

import socket
import struct

import pytest

from storage_backends import CorruptObject, StoreUnavailable, open_backend

from stores import has_module, need, run

TOKEN = b"nixl-test-token-0123456789abcdef"


@pytest.fixture(scope="module")
def token_server():
    need(has_module("nixl"), "python package 'nixl' is not installed")
    from storage_backends.nixl_server import NixlStoreServer

    server = NixlStoreServer(capacity_bytes=8 << 20, token=TOKEN).start()
    yield server
    server.stop()


def raw_conn(server) -> socket.socket:
    s = socket.create_connection((server.host, server.port), 5)
    s.settimeout(5)
    return s


def recv_frame(s: socket.socket) -> dict | None:
    """One frame, or None at EOF."""
    import json

    head = b""
    while len(head) < 4:
        chunk = s.recv(4 - len(head))
        if not chunk:
            return None
        head += chunk
    (n,) = struct.unpack("<I", head)
    body = b""
    while len(body) < n:
        chunk = s.recv(n - len(body))
        if not chunk:
            return None
        body += chunk
    return json.loads(body)


def send_frame(s: socket.socket, msg: dict) -> None:
    import json

    body = json.dumps(msg).encode()
    s.sendall(struct.pack("<I", len(body)) + body)


def closes(s: socket.socket) -> bool:
    """Whether the server closes s (EOF) within the socket timeout, frames before it ignored."""
    try:
        while recv_frame(s) is not None:
            pass
        return True
    except (socket.timeout, ConnectionError):
        return False


def test_the_right_token_works_from_a_file_or_the_environment(token_server, tmp_path, monkeypatch):
    (tmp_path / "token").write_bytes(TOKEN + b"\n")

    async def round_trip(**opts):
        b = open_backend(token_server.url + "?prefix=t:", **opts)
        try:
            await b.put("k", b"value")
            return await b.get("k")
        finally:
            await b.close()

    assert run(round_trip(token=TOKEN)) == b"value"
    assert run(round_trip(token_file=str(tmp_path / "token"))) == b"value"
    monkeypatch.setenv("VERICACHE_NIXL_TOKEN_FILE", str(tmp_path / "token"))
    assert run(round_trip()) == b"value"


@pytest.mark.parametrize("opts", [{}, {"token": b"wrong-token-0123456789abcdef"}], ids=["none", "wrong"])
def test_a_client_without_the_token_is_refused(token_server, opts, monkeypatch):
    monkeypatch.delenv("VERICACHE_NIXL_TOKEN", raising=False)
    monkeypatch.delenv("VERICACHE_NIXL_TOKEN_FILE", raising=False)

    async def go():
        b = open_backend(token_server.url, timeout_s=3, connect_timeout_s=2, **opts)
        try:
            with pytest.raises(StoreUnavailable, match="token|authentication"):
                await b.get("k")
            with pytest.raises(StoreUnavailable):  # and again: no half-open connection is reused
                await b.exists("k")
        finally:
            await b.close()

    run(go(), timeout=60)


def test_a_client_with_a_token_refuses_a_server_that_cannot_prove_it(nixl_url):
    async def go():
        b = open_backend(nixl_url, token=TOKEN, timeout_s=3, connect_timeout_s=2)
        try:
            with pytest.raises(StoreUnavailable, match="prove"):
                await b.get("k")
        finally:
            await b.close()

    run(go(), timeout=60)


def test_requests_before_hello_are_refused(token_server):
    s = raw_conn(token_server)
    try:
        greeting = recv_frame(s)
        assert greeting["auth"] is True and greeting["nonce"]
        send_frame(s, {"op": "lookup", "key": "k"})
        assert "authentication" in recv_frame(s)["error"]
        assert closes(s)
    finally:
        s.close()


@pytest.mark.parametrize("length", [0xFFFFFFF0, 5 << 20], ids=["4GiB", "5MiB"])
def test_an_oversized_control_frame_closes_the_connection_unread(nixl_server, length):
    """A frame header announcing more than MAX_FRAME bytes is not waited for: the server closes the
    connection at once, and serves the next client."""
    s = raw_conn(nixl_server)
    try:
        s.sendall(struct.pack("<I", length) + b"{")
        assert closes(s), "the server waited for the announced bytes"
    finally:
        s.close()

    async def still_serving():
        b = open_backend(nixl_server.url + "?prefix=after:")
        try:
            await b.put("after", b"1")
            return await b.get("after")
        finally:
            await b.close()

    assert run(still_serving()) == b"1"


def test_before_hello_a_frame_over_4_kib_closes_the_connection(token_server):
    s = raw_conn(token_server)
    try:
        recv_frame(s)  # the greeting
        send_frame(s, {"op": "hello", "pad": "x" * 8192})
        assert closes(s)
    finally:
        s.close()


def test_object_size_is_checked_before_the_transfer(token_server):
    async def go():
        b = open_backend(token_server.url + "?prefix=sz:", token=TOKEN, max_object_bytes=1000)
        try:
            await b.put("big", bytes(range(256)) * 20)  # 5120 bytes
            transfers = []
            real_xfer = b._xfer

            async def spy(op, offset, n):
                transfers.append((op, n))
                await real_xfer(op, offset, n)

            b._xfer = spy
            with pytest.raises(CorruptObject, match="5120 bytes"):
                await b.get("big")
            assert transfers == []  # refused from the size the server reported
            assert await b.get_range("big", 0, 500) == (bytes(range(256)) * 2)[:500]  # a range bounds itself
        finally:
            await b.close()

    run(go())


def test_token_never_in_the_url(token_server):
    with pytest.raises(ValueError, match="token_file") as e:
        open_backend(f"{token_server.url}?token={TOKEN.decode()}")
    assert TOKEN.decode() not in str(e.value)
    with pytest.raises(ValueError, match="16 bytes"):
        open_backend(token_server.url, token=b"short")
