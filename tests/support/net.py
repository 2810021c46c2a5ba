"""Loopback helpers the tests share: a free port, waiting for a condition, and a TCP relay that injects the
faults a client must survive (a connection dropped mid-transfer, a slow answer, a stream cut short).

    port = free_port()
    got = wait_for(lambda: store.lookup(prompt), timeout_s=10)       # its first truthy answer, or AssertionError
    with TcpProxy("127.0.0.1", port, delay_s=5) as proxied_port: ...  # or proxy = TcpProxy(...); proxy.close()
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Callable

from benchmarks.kit.vllm_server import free_port  # noqa: F401 - one free_port for the tests and the benchmarks


def wait_until(check, timeout_s: float = 30.0, every_s: float = 0.05, ignore=()):
    """check()'s first truthy answer, asked every every_s seconds for timeout_s; None when none came in time.
    An exception of a type in `ignore` counts as "not yet" (a server still starting); any other propagates."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            got = check()
        except ignore:
            got = None
        if got:
            return got
        time.sleep(every_s)
    return None


def wait_for(
    check, timeout_s: float = 30.0, every_s: float = 0.05, what: str | Callable[[], str] | None = None, ignore=()
):
    """wait_until(...)'s answer; AssertionError when none came in time: "timed out", "<what>: not within
    <timeout_s> s", or, `what` a function, what() (asked then: a server log's tail, say)."""
    got = wait_until(check, timeout_s, every_s, ignore)
    if got:
        return got
    if what is None:
        raise AssertionError("timed out")
    raise AssertionError(what() if callable(what) else f"{what}: not within {timeout_s} s")


class TcpProxy:
    """A relay from a free port of 127.0.0.1 (.port) to host:port, one thread per direction of a connection.
    close() drops every connection mid-transfer (a store gone); delay_s: each chunk of an answer (upstream to
    client) waits this long first; cut_sse_after: a connection closes once its answer carried this many bytes
    after its first `data: ` (a streamed completion dies mid-stream; other answers pass whole). pause(): nothing is
    relayed until resume() (a stalled store: connections are accepted, nothing is answered). bytes_relayed
    counts both directions, cuts the connections cut. `with TcpProxy(...) as port:` closes it at the end."""

    def __init__(self, host: str, port: int, delay_s: float = 0.0, cut_sse_after: int | None = None):
        self.target = (host, port)
        self.delay_s, self.cut = delay_s, cut_sse_after
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.closed = False
        self.bytes_relayed = 0
        self.cuts = 0
        self.running = threading.Event()  # cleared: paused
        self.running.set()
        threading.Thread(target=self._accept, daemon=True).start()

    def __enter__(self) -> int:
        return self.port

    def __exit__(self, *exc) -> None:
        self.close()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, 5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)  # the 5 s is for connecting: an idle pooled connection must stay up
            self.conns += [client, upstream]
            for a, b, answer in ((client, upstream, False), (upstream, client, True)):
                threading.Thread(target=self._pipe, args=(a, b, answer), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, answer: bool) -> None:
        sent = None  # bytes of the answer since its first `data: `
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if answer and self.delay_s:
                    time.sleep(self.delay_s)
                if answer and self.cut is not None:
                    if sent is None and b"data: " in data:
                        sent = len(data) - data.index(b"data: ")
                    elif sent is not None:
                        sent += len(data)
                    if sent is not None and sent > self.cut:
                        self.cuts += 1
                        break
                while not self.running.wait(0.1) and not self.closed:
                    pass  # paused: held until resume()
                self.bytes_relayed += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def pause(self) -> None:
        self.running.clear()

    def resume(self) -> None:
        self.running.set()

    def close(self) -> None:
        self.closed = True
        self.running.set()
        for s in [self.sock, *self.conns]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
