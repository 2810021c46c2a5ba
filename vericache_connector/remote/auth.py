"""Who may talk to the verifier, and what a peer that may not can cost it.

ZeroMQ CURVE (CurveZMQ: Curve25519 keys, every frame encrypted and authenticated) between drafters and the
verifier. The verifier holds a secret key; each drafter holds a key pair of its own and the verifier's
public key; the verifier admits only the drafter public keys it is given, through a ZAP handler (the
ZeroMQ Authentication Protocol: libzmq asks it during the handshake, before any message of the peer is
delivered). The shared token (rpc.py) still goes with every call, now inside the encrypted channel.

Keys are Z85 text (40 characters: `python -c "import zmq; print(*zmq.curve_keypair())"` prints a public
and a secret key), each from NAME_FILE (a mounted Secret file) or NAME (credentials.secret_from_env):
  the verifier  VERICACHE_VERIFIER_SECRET_KEY          its secret key
                VERICACHE_VERIFIER_CLIENT_KEYS         the drafters' public keys (whitespace or comma separated)
  a drafter     VERICACHE_VERIFIER_CLIENT_SECRET_KEY   its secret key
                VERICACHE_VERIFIER_PUBLIC_KEY          the verifier's public key
Without keys both sides refuse to start, unless VERICACHE_VERIFIER_INSECURE=1 (a laptop, a test): calls
then travel in clear as they did before CURVE, and both sides log a warning saying so.

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
bounded rate (peer_log.LogLimiter), and anything a peer sends is escaped (`esc`) before it reaches a log line.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass

from storage_backends.credentials import secret_from_env

from .peer_log import LogLimiter, esc

SECRET_KEY_ENV = "VERICACHE_VERIFIER_SECRET_KEY"
CLIENT_KEYS_ENV = "VERICACHE_VERIFIER_CLIENT_KEYS"
CLIENT_SECRET_KEY_ENV = "VERICACHE_VERIFIER_CLIENT_SECRET_KEY"
PUBLIC_KEY_ENV = "VERICACHE_VERIFIER_PUBLIC_KEY"
INSECURE_ENV = "VERICACHE_VERIFIER_INSECURE"
ZAP_DOMAIN = b"vericache-verifier"
logger = logging.getLogger("vericache.verifier")


# ---- keys ---------------------------------------------------------------------------------------------
def _key(value: bytes, name: str) -> bytes:
    """A Z85 CURVE key checked (40 characters, 32 bytes); ValueError naming the variable, never the value."""
    from zmq.utils import z85

    try:
        ok = len(value) == 40 and len(z85.decode(value)) == 32
    except (ValueError, KeyError, TypeError, IndexError, struct.error):  # not Z85 characters
        ok = False
    if not ok:
        raise ValueError(f"{name} is not a CURVE key (40 Z85 characters, as zmq.curve_keypair() makes them)")
    return bytes(value)


def _curve_available() -> None:
    import zmq

    if not zmq.has("curve"):
        raise ValueError(f"this pyzmq's libzmq {zmq.zmq_version()} has no CURVE: set {INSECURE_ENV}=1 to run in clear")


def insecure(env=None) -> bool:
    """VERICACHE_VERIFIER_INSECURE=1: no CURVE (calls in clear). Any other value but unset/0 is an error."""
    value = (os.environ if env is None else env).get(INSECURE_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{INSECURE_ENV} must be 1 or 0, got {esc(value, 20)!r}")
    return value == "1"


def _keys(names: tuple[str, ...], env, side: str) -> list[bytes] | None:
    """The values of names (each required), or None when none is set and the insecure mode is on."""
    values = {n: secret_from_env(n, env, what=n) for n in names}
    off = insecure(env)
    if all(v is None for v in values.values()):
        if off:
            return None
        files = " and ".join(f"{n}_FILE" for n in names)
        raise ValueError(
            f"no CURVE keys for the {side}: set {files} (mounted Secret files; or the variables themselves), "
            f"or {INSECURE_ENV}=1 to run without (calls in clear: a test setup only)"
        )
    if off:
        raise ValueError(f"{INSECURE_ENV}=1 and CURVE keys are both set for the {side}: unset one")
    missing = [n for n, v in values.items() if v is None]
    if missing:
        raise ValueError(f"the {side} needs {' and '.join(missing)} too (a _FILE path or the value)")
    _curve_available()
    return [values[n] for n in names]


@dataclass(frozen=True, repr=False)
class ServerKeys:
    secret: bytes  # Z85
    public: bytes  # Z85, derived from secret
    clients: frozenset[bytes]  # raw 32-byte public keys of the drafters admitted

    def __repr__(self) -> str:
        return f"<ServerKeys public={self.public.decode()} clients={len(self.clients)}>"  # never the secret


@dataclass(frozen=True, repr=False)
class ClientKeys:
    secret: bytes
    public: bytes
    server: bytes  # the verifier's public key (Z85)

    def __repr__(self) -> str:
        return f"<ClientKeys public={self.public.decode()} server={self.server.decode()}>"


def server_keys(env=None) -> ServerKeys | None:
    """The verifier's keys from the environment (module docstring); None in the insecure mode."""
    import zmq
    from zmq.utils import z85

    got = _keys((SECRET_KEY_ENV, CLIENT_KEYS_ENV), env, "verifier")
    if got is None:
        return None
    secret = _key(got[0], SECRET_KEY_ENV)
    clients = [c for c in got[1].replace(b",", b" ").split() if c]
    if not clients:
        raise ValueError(f"{CLIENT_KEYS_ENV} holds no public key")
    raw = frozenset(z85.decode(_key(c, f"a key in {CLIENT_KEYS_ENV}")) for c in clients)
    return ServerKeys(secret, zmq.curve_public(secret), raw)


def client_keys(env=None) -> ClientKeys | None:
    """A drafter's keys from the environment (module docstring); None in the insecure mode."""
    import zmq

    got = _keys((CLIENT_SECRET_KEY_ENV, PUBLIC_KEY_ENV), env, "drafter")
    if got is None:
        return None
    secret = _key(got[0], CLIENT_SECRET_KEY_ENV)
    return ClientKeys(secret, zmq.curve_public(secret), _key(got[1].strip(), PUBLIC_KEY_ENV))


def secure_client(sock, keys: ClientKeys | None) -> None:
    if keys is not None:
        sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = keys.secret, keys.public, keys.server


def secure_server(sock, keys: ServerKeys | None) -> None:
    """CURVE on a server socket, with ZAP enforced: no handler, no handshake (never 'any key')."""
    import zmq

    if keys is not None:
        sock.curve_server = True
        sock.curve_secretkey, sock.curve_publickey = keys.secret, keys.public
        sock.zap_domain = ZAP_DOMAIN
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


# ---- the verifier's gate --------------------------------------------------------------------------------
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


# ---- keys for one machine (a laptop, the demo, tests) ----------------------------------------------------
def write_keys(folder: str) -> dict[str, str]:
    """A fresh verifier key pair and one drafter key pair, in files only this user reads (0600) under
    folder; returns the environment naming them (each side reads its own two). In a cluster the keys come
    from Secrets instead (k8s/secrets/verifier.example.yaml)."""
    import zmq

    os.makedirs(folder, mode=0o700, exist_ok=True)
    server_pub, server_sec = zmq.curve_keypair()
    client_pub, client_sec = zmq.curve_keypair()
    files = {
        SECRET_KEY_ENV: ("verifier.key", server_sec),
        CLIENT_KEYS_ENV: ("drafters.pub", client_pub),
        CLIENT_SECRET_KEY_ENV: ("drafter.key", client_sec),
        PUBLIC_KEY_ENV: ("verifier.pub", server_pub),
    }
    env = {}
    for name, (file, value) in files.items():
        path = os.path.join(folder, file)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(value + b"\n")
        env[f"{name}_FILE"] = path
    return env


def main(argv: list[str] | None = None) -> int:
    """python -m vericache_connector.remote.auth DIR: write_keys(DIR), and print the environment."""
    import argparse

    p = argparse.ArgumentParser(description="Write a verifier key pair and a drafter key pair (CURVE) to DIR.")
    p.add_argument("dir")
    for name, path in write_keys(p.parse_args(argv).dir).items():
        print(f"{name}={path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
