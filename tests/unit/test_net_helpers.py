"""tests/support/net.py, the loopback helpers the store, router and vLLM tests share: wait_until / wait_for
(their answers and time-out messages) and TcpProxy's faults (a slow answer, a stream cut after its first
`data: ` bytes, every connection dropped by close())."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from net import TcpProxy, free_port, wait_for, wait_until


def test_wait_until_gives_the_first_truthy_answer_or_none():
    answers = iter([0, None, "", "got", "later"])
    assert wait_until(lambda: next(answers), 5, 0.001) == "got"
    t0 = time.monotonic()
    assert wait_until(lambda: [], 0.2, 0.01) is None
    assert 0.2 <= time.monotonic() - t0 < 5


def test_wait_until_ignores_only_the_errors_it_is_told_to():
    calls = []

    def starting():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("not up yet")
        return True

    def exited():
        raise RuntimeError("the server exited")

    assert wait_until(starting, 5, 0.001, ignore=ConnectionError) is True
    with pytest.raises(RuntimeError, match="exited"):
        wait_until(exited, 5, 0.001, ignore=ConnectionError)


def test_wait_for_time_out_messages():
    with pytest.raises(AssertionError, match="^timed out$"):
        wait_for(lambda: False, 0.05, 0.01)
    with pytest.raises(AssertionError, match=r"^replica in sync: not within 0\.05 s$"):
        wait_for(lambda: False, 0.05, 0.01, what="replica in sync")
    with pytest.raises(AssertionError, match="^log tail$"):
        wait_for(lambda: False, 0.05, 0.01, what=lambda: "log tail")
    assert wait_for(lambda: 7, 1) == 7


class _Upstream:
    """A loopback server that reads one request and answers `answer`, one chunk per `chunks`, then closes."""

    def __init__(self, chunks: list[bytes], gap_s: float = 0.05):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.chunks, self.gap_s = chunks, gap_s
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.recv(1024)
                try:
                    for c in self.chunks:
                        conn.sendall(c)
                        time.sleep(self.gap_s)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def _ask(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), 10) as c:
        c.sendall(b"GET / HTTP/1.1\r\n\r\n")
        got = b""
        while data := c.recv(65536):
            got += data
        return got


def test_proxy_relays_whole_answers_and_counts_their_bytes():
    up = _Upstream([b"HTTP/1.1 200 OK\r\n\r\n", b"x" * 1000])
    try:
        with TcpProxy("127.0.0.1", up.port) as port:
            assert _ask(port) == b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * 1000
    finally:
        up.close()


def test_proxy_delays_each_chunk_of_an_answer():
    up = _Upstream([b"a", b"b"], gap_s=0.2)  # two reads of the answer at least: two delays
    proxy = TcpProxy("127.0.0.1", up.port, delay_s=0.5)
    try:
        t0 = time.monotonic()
        assert _ask(proxy.port) == b"ab"
        assert time.monotonic() - t0 >= 1.0
        assert proxy.bytes_relayed >= len(b"GET / HTTP/1.1\r\n\r\n") + 2
    finally:
        proxy.close()
        up.close()


def test_proxy_cuts_a_stream_after_its_first_data_bytes():
    head, events = b"HTTP/1.1 200 OK\r\n\r\n", [b"data: " + b"e" * 94 for _ in range(10)]
    up, plain_up = _Upstream([head, *events]), _Upstream([head, b"no events " * 50])
    proxy = TcpProxy("127.0.0.1", up.port, cut_sse_after=250)
    plain = TcpProxy("127.0.0.1", plain_up.port, cut_sse_after=250)
    try:
        got = _ask(proxy.port)
        assert got.startswith(head + events[0]) and len(got) < len(head) + 10 * 100 and proxy.cuts == 1
        assert len(_ask(plain.port)) == len(head) + 500 and plain.cuts == 0  # an answer with no `data: `: whole
    finally:
        for p in (proxy, plain, up, plain_up):
            p.close()


def test_proxy_close_drops_a_live_connection():
    up = _Upstream([b"first", *[b"more"] * 100], gap_s=0.05)
    proxy = TcpProxy("127.0.0.1", up.port)
    try:
        with socket.create_connection(("127.0.0.1", proxy.port), 10) as c:
            c.sendall(b"hi")
            assert c.recv(5) == b"first"
            proxy.close()
            c.settimeout(10)
            rest = b""
            try:
                while data := c.recv(65536):
                    rest += data
            except ConnectionError:
                pass
            assert len(rest) < 100 * 4  # cut off, not the whole answer
    finally:
        up.close()


def test_free_port_is_free():
    port = free_port()
    with socket.create_server(("127.0.0.1", port)):
        pass
