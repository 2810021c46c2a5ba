"""The verifier's socket and its gate: who gets a connection, and what a peer without a key can cost it.

open_socket makes the verifier's ROUTER socket (its limits, CURVE) and its Gate, and binds it; close_socket
takes them down. The Gate is the socket's ZAP handler (it admits the drafter keys auth.server_keys read) and
keeps its connection budgets, on a thread of its own.

What a peer without a key can make the verifier hold: libzmq reads a handshake frame whole before the
mechanism looks at it, up to the socket's ZMQ_MAXMSGSIZE, so calls go in frames of at most
rpc.FRAME_BYTES and the socket refuses bigger ones; a handshake not done within handshake_s closes the
connection; and the Gate caps connections in two budgets (libzmq has no such option: the socket monitor
reports each accepted connection, and the Gate shuts one down, which libzmq sees as the peer leaving).
A connection not known to be admitted yet counts toward `max_pending` (and `max_pending_per_address` for
its source address): one more evicts the oldest of them, so idle or reconnecting sockets without a key
hold at most those slots and never a drafter's. A connection is admitted when ZAP admits a key from its
address (the newest pending one from there: a drafter's handshake takes milliseconds, an idle socket never
gets there), or once it outlives handshake_s (libzmq closes unfinished handshakes by then); admitted
connections count toward `max_connections`, and one beyond it is closed at once.
Measured: 200 stalled connections each holding a 64 KiB handshake frame cost +19 MB; with the 8 MiB
frames allowed before, the same cost +1.7 GB. Refused handshakes and dropped connections are logged at a
bounded rate (peer_log.LogLimiter), and anything a peer sends is escaped (peer_log.esc) before it reaches a
log line.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

from . import rpc
from .auth import CLIENT_KEYS_ENV, INSECURE_ENV, ServerKeys, secure_server
from .peer_log import LogLimiter, esc

logger = logging.getLogger("vericache.verifier")


def open_socket(ctx, st, keys: ServerKeys | None, limiter: LogLimiter):
    """The verifier's ROUTER socket on ctx, with CURVE (keys; None: calls in clear) and its Gate started, bound
    to st.host:st.port (0: any free port); returns (socket, gate, port). st: verifier_server.ServerSettings."""
    import zmq

    sock = ctx.socket(zmq.ROUTER)
    for opt, value in (
        (zmq.LINGER, 0),
        # a frame over this (a handshake's too) and ZMQ drops the peer: what a peer without a key can
        # make us hold; calls travel in frames of FRAME_BYTES (rpc.call_frames)
        (zmq.MAXMSGSIZE, rpc.FRAME_BYTES + 1024),
        (zmq.HANDSHAKE_IVL, int(st.handshake_s * 1000)),
        (zmq.HEARTBEAT_IVL, int(st.heartbeat_s * 1000)),
        (zmq.HEARTBEAT_TIMEOUT, int(3 * st.heartbeat_s * 1000)),
    ):
        sock.setsockopt(opt, value)
    secure_server(sock, keys)
    gate = Gate(  # the ZAP handler before the socket binds
        ctx,
        sock,
        keys,
        st.max_connections,
        limiter,
        max_pending=st.max_pending,
        max_pending_per_address=st.max_pending_per_address,
        handshake_s=st.handshake_s,
    )
    if st.port == 0:
        port = sock.bind_to_random_port(f"tcp://{st.host}")
    else:
        sock.bind(f"tcp://{st.host}:{st.port}")
        port = st.port
    gate.port = port
    gate.start()
    if keys is None:
        logger.warning(
            "no CURVE keys (%s=1): calls travel in clear, and anyone who reaches the port is read before "
            "the token is checked",
            INSECURE_ENV,
        )
    return sock, gate, port


def close_socket(ctx, sock, gate: Gate) -> None:
    """The gate stopped, then the socket closed; the context ends once the gate's thread has."""
    import zmq

    gate.close()
    try:
        sock.disable_monitor()
    except zmq.ZMQError:
        pass
    sock.close(0)
    if not gate.is_alive():
        ctx.term()


class Gate(threading.Thread):
    """The ZAP handler (admits the drafters' keys) and the connection budgets of one server socket (module
    docstring), on their own thread. Create it before the socket binds (the ZAP endpoint must be there
    first), start() it, and close() it before the socket is closed."""

    EVENTS = ("ACCEPTED", "DISCONNECTED", "HANDSHAKE_FAILED_NO_DETAIL", "HANDSHAKE_FAILED_PROTOCOL")

    def __init__(
        self,
        ctx,
        sock,
        keys: ServerKeys | None,
        max_connections: int,
        limiter: LogLimiter,
        max_pending: int = 64,
        max_pending_per_address: int = 8,
        handshake_s: float = 5.0,
    ):
        import zmq

        super().__init__(name="vericache-verifier-gate", daemon=True)
        self.zmq, self.keys, self.max_connections, self.limit = zmq, keys, max_connections, limiter
        self.max_pending, self.max_pending_per_address = max_pending, max_pending_per_address
        self.handshake_s = handshake_s
        self.zap = None
        if keys is not None:
            self.zap = ctx.socket(zmq.REP)
            self.zap.setsockopt(zmq.LINGER, 0)
            self.zap.bind("inproc://zeromq.zap.01")
        mask = 0
        for name in self.EVENTS:
            mask |= getattr(zmq, f"EVENT_{name}")
        self.sock, self.mon = sock, sock.get_monitor_socket(mask)
        self.port: int | None = None  # set once the socket is bound: only its own connections are cut
        self.open: set[int] = set()  # fds of admitted connections: max_connections
        self.pending: dict[int, tuple[str, float]] = {}  # fd -> (source address, accepted at), oldest first
        self.counts = dict(refused=0, cut=0, failed=0, evicted=0)
        self.stop_event = threading.Event()

    def run(self) -> None:
        zmq = self.zmq
        poller = zmq.Poller()
        poller.register(self.mon, zmq.POLLIN)
        if self.zap is not None:
            poller.register(self.zap, zmq.POLLIN)
        try:
            while not self.stop_event.is_set():
                for s, _ in poller.poll(200):
                    if s is self.zap:
                        self._authenticate(self.zap.recv_multipart())
                    else:
                        self._event(s)
                self.limit.flush()
        finally:
            if self.zap is not None:
                self.zap.close(0)
            self.mon.close(0)

    def close(self) -> None:
        self.stop_event.set()
        if self.is_alive():
            self.join(5)

    def _authenticate(self, msg: list[bytes]) -> None:
        """One ZAP request: [version, id, domain, address, routing id, mechanism, credentials...]."""
        if len(msg) < 6:
            return  # not from libzmq; nothing to answer to
        request_id, address, mechanism, cred = msg[1], msg[3], msg[5], msg[6:]
        ok = mechanism == b"CURVE" and len(cred) == 1 and cred[0] in self.keys.clients
        if not ok:
            self.counts["refused"] += 1
            why = "a key not in " + CLIENT_KEYS_ENV if mechanism == b"CURVE" else f"mechanism {esc(mechanism)}"
            shown = esc(address.decode("utf-8", "replace"), 64)
            self.limit("refused handshakes", "verifier: refused a handshake from %s: %s", shown, why)
        if ok:
            self._admitted_from(address.decode("utf-8", "replace"))
        status = [b"200", b"OK", b"drafter"] if ok else [b"400", b"not admitted", b""]
        self.zap.send_multipart([b"1.0", request_id, *status, b""])

    def _event(self, mon) -> None:
        from zmq.utils.monitor import recv_monitor_message

        e = recv_monitor_message(mon)
        kind, fd = e["event"], e["value"]
        zmq = self.zmq
        if kind == zmq.EVENT_ACCEPTED:
            self._accepted(fd)
        elif kind == zmq.EVENT_DISCONNECTED:
            self.open.discard(fd)
            self.pending.pop(fd, None)
        else:  # a handshake that failed for a reason ZAP did not see (wrong mechanism, garbage)
            self.counts["failed"] += 1
            self.limit("failed handshakes", "verifier: a handshake failed (%s)", esc(e["event"].name))

    def _accepted(self, fd: int) -> None:
        """A new connection: closed if the drafters' budget is full; else pending, after the oldest pending
        one (its own address's first) is shut down to make room if its budget is full."""
        address = self._peer(fd)
        if address is None:
            return
        now = time.monotonic()
        for old, (_, t) in list(self.pending.items()):  # outlived the handshake deadline: admitted
            if now - t > self.handshake_s:
                del self.pending[old]
                self._admit(old)
        if len(self.open) >= self.max_connections:
            self._over_cap(fd)
            return
        mine = [f for f, (a, _) in self.pending.items() if a == address]
        victim = mine[0] if len(mine) >= self.max_pending_per_address else None
        if victim is None and len(self.pending) >= self.max_pending:
            victim = next(iter(self.pending))
        if victim is not None:
            shown = self.pending.pop(victim)[0]
            if self._cut(victim):
                self.counts["evicted"] += 1
                self.limit(
                    "connections without a handshake",
                    "verifier: too many connections without a finished handshake: closed the oldest (from %s)",
                    esc(shown, 64),
                )
        self.pending[fd] = (address, now)

    def _admitted_from(self, address: str) -> None:
        """ZAP admitted a key from `address`: its newest pending connection is the drafter's."""
        fd = next((f for f, (a, _) in reversed(self.pending.items()) if a == address), None)
        if fd is not None:
            del self.pending[fd]
            self._admit(fd)

    def _admit(self, fd: int) -> None:
        if len(self.open) < self.max_connections:
            self.open.add(fd)
        else:
            self._over_cap(fd)

    def _over_cap(self, fd: int) -> None:
        if self._cut(fd):
            self.counts["cut"] += 1
            self.limit(
                "connections over the cap",
                "verifier: %d drafter connections open, the cap is %d: closed a new one",
                len(self.open) + 1,
                self.max_connections,
            )

    def _peer(self, fd: int) -> str | None:
        """The source address of the accepted connection `fd`, or None."""
        return self._on_our_socket(fd, lambda s: str(s.getpeername()[0]))

    def _cut(self, fd: int) -> bool:
        """shutdown() the accepted connection `fd` (not close: the fd stays libzmq's, which then sees the
        connection end and cleans up)."""
        return self._on_our_socket(fd, lambda s: s.shutdown(socket.SHUT_RDWR) or True) is not None

    def _on_our_socket(self, fd: int, use):
        """use(a duplicate of fd) if fd is a connection on our port, else None (the event may be older than
        the fd's current use; an OSError is None too)."""
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            return None
        try:
            if self.port is None or s.getsockname()[1] != self.port:
                return None
            return use(s)
        except OSError:
            return None
        finally:
            s.close()  # the duplicate only
