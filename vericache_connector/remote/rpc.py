"""The drafter <-> verifier protocol: msgspec messages over ZeroMQ (DEALER drafters, one ROUTER verifier).

Why ZMQ + msgspec: it is what vLLM (engine core <-> API server) and LMCache (its multiprocess server) run
between their own processes, both are installed with vLLM, and the two properties the pipeline needs come
with it. A drafter keeps drafting while its verify call is in flight and only polls its socket between
draft steps (no thread, no event loop in the drafter's decode loop), and the verifier drains every call
that arrived during its last forward in one go, which is where the batching across drafters comes from.
Reconnection after a verifier restart is ZMQ's own. msgspec decodes into typed structs, so a malformed
call is a clear error before it reaches the model.

Frames: drafter -> verifier [token, body...]; verifier -> drafter [body] (ROUTER adds/strips the peer id).
  token  the shared secret (VERICACHE_VERIFIER_TOKEN_FILE, a mounted Kubernetes Secret, or
         VERICACHE_VERIFIER_TOKEN), checked with a constant-time compare before the body is decoded.
  body   msgpack of one Call (Verify | Release | Stats), in frames of FRAME_BYTES (the last one shorter;
         most calls are one frame); the answer is one Answer (Verdict | Failure | Usage).
Security (auth.py, gate.py): ZeroMQ CURVE encrypts every frame and the verifier admits only the drafters' keys,
during the handshake, before any call is read; the token goes inside. Frames are small because libzmq
reads a handshake frame whole before checking it: ZMQ drops a peer whose frame is over FRAME_BYTES.
Bounds: a body over max_call_bytes is refused with a Failure; drafts per call <= MAX_DRAFTS; ids are
checked against the model's vocab.
Liveness: ZMTP heartbeats, and the client watches its socket's connection events, so a drafter whose
verifier died (or whose host vanished) gives up its call within seconds instead of at the call's deadline.
"""

from __future__ import annotations

import logging
import time
from typing import Union
from urllib.parse import urlsplit

import msgspec

from storage_backends.credentials import read_secret_file, secret_from_env

logger = logging.getLogger("vericache.remote")
TOKEN_ENV = "VERICACHE_VERIFIER_TOKEN"  # or TOKEN_ENV + "_FILE": the path of a mounted Secret
MIN_TOKEN_BYTES = 16
MAX_DRAFTS = 64
MAX_CALL_BYTES = 8 << 20  # a greedy call is a few KiB; sampling adds 4 * vocab bytes per draft
MAX_ANSWER_BYTES = 1 << 20
DEFAULT_PORT = 8477
DEFAULT_TIMEOUT_S = 5.0  # one verify call (the opening one: RemoteCacheConfig.verifier_load_timeout_s)
FRAME_BYTES = 64 << 10  # the most a frame holds (and what a peer without a key can make the verifier hold)
HEARTBEAT_S = 1.0  # client pings; a verifier silent for 3x this (its host gone) ends the connection
FROM_ENV = "env"  # keys=FROM_ENV: the CURVE keys from the environment (auth.client_keys / server_keys)


# ---- messages ---------------------------------------------------------------------------------------
class Verify(msgspec.Struct, tag="verify", frozen=True):
    """Check `drafts` after prompt + emitted. The verifier answers the number of leading drafts the full
    KV agrees with (greedy: argmax; sampling: Leviathan's rule with the draft probs `q`) and the next token
    after them: the correction at the first rejection, or the bonus after all of them. drafts may be empty
    (the call then only answers the next token: the first call of a request opens it that way)."""

    model: str  # the drafter's model identity ('folder.fingerprint'): the verifier refuses another model
    request: str  # the drafter's request id (<= 128 chars)
    seq: int  # call number within the request, echoed
    prompt: list[int]
    stored: int  # prompt[:stored] is the stored prefix whose full copy the verifier loads
    emitted: list[int]  # verified tokens so far
    drafts: list[int]
    max_new: int  # the request's token budget (how much room the verifier's cache needs)
    temperature: float = 0.0
    seed: int = 0  # sampling: the verifier's RNG for this call is seeded from (seed, len(emitted))
    q: bytes = b""  # sampling: draft probs, float32 [len(drafts), vocab], little endian


class Release(msgspec.Struct, tag="release", frozen=True):
    """The request is done (or abandoned): free its resident KV now."""

    request: str


class Stats(msgspec.Struct, tag="stats", frozen=True):
    """Ask for the verifier's counters (tests, monitoring)."""


class Verdict(msgspec.Struct, tag="verdict", frozen=True):
    request: str
    seq: int
    accepted: int  # leading drafts accepted
    token: int  # the next token after them (correction or bonus)
    loaded: bool = False  # this call loaded the request's full KV from the store
    batch: int = 1  # rows in the forward that verified this call


class Failure(msgspec.Struct, tag="failure", frozen=True):
    request: str  # "" when the call could not be read
    seq: int
    code: str  # auth | malformed | too_large | model | store | busy | internal
    message: str


class Usage(msgspec.Struct, tag="usage", frozen=True):
    residents: int
    resident_bytes: int
    budget_bytes: int
    calls: int
    forwards: int
    batched_rows: int  # rows verified in forwards of more than one row
    max_batch: int
    loads: int
    evicted: int
    expired: int
    released: int
    failures: dict[str, int]


Call = Union[Verify, Release, Stats]
Answer = Union[Verdict, Failure, Usage]
_encoder = msgspec.msgpack.Encoder()
_call_decoder = msgspec.msgpack.Decoder(Call)
_answer_decoder = msgspec.msgpack.Decoder(Answer)


def encode(msg) -> bytes:
    return _encoder.encode(msg)


def call_frames(token: bytes, call: Call) -> list[bytes]:
    """[token, body in frames of FRAME_BYTES, the last one shorter] (the verifier joins them)."""
    body = encode(call)
    return [token, *(body[i : i + FRAME_BYTES] for i in range(0, len(body), FRAME_BYTES))]


def decode_call(data: bytes) -> Call:
    """ValueError with what is wrong (msgspec names the field), never the raw bytes."""
    try:
        return _call_decoder.decode(data)
    except msgspec.DecodeError as e:  # ValidationError is a DecodeError
        raise ValueError(f"not a verifier call: {e}") from None


def decode_answer(data: bytes) -> Answer:
    if len(data) > MAX_ANSWER_BYTES:
        raise ValueError(f"answer of {len(data)} bytes is over the {MAX_ANSWER_BYTES}-byte limit")
    try:
        return _answer_decoder.decode(data)
    except msgspec.DecodeError as e:
        raise ValueError(f"not a verifier answer: {e}") from None


# ---- settings -----------------------------------------------------------------------------------------
def verifier_token(path: str | None = None) -> bytes:
    """The shared token: the file `path`, else $VERICACHE_VERIFIER_TOKEN_FILE / $VERICACHE_VERIFIER_TOKEN.
    Never a command-line value (argv shows in ps and in logs). ValueError if none or too short."""
    token = read_secret_file(path, "verifier token") if path else secret_from_env(TOKEN_ENV, what="verifier token")
    if token is None:
        raise ValueError(
            f"no verifier token: set {TOKEN_ENV}_FILE (a mounted Secret) or {TOKEN_ENV}; "
            "drafters and the verifier must share it"
        )
    if not MIN_TOKEN_BYTES <= len(token) <= FRAME_BYTES:
        raise ValueError(
            f"the verifier token needs at least {MIN_TOKEN_BYTES} bytes (and at most {FRAME_BYTES}), got {len(token)}"
        )
    return token


def zmq_endpoint(url: str) -> str:
    """'tcp://host:port' checked (the verifier's own protocol); ValueError naming the URL otherwise."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except (ValueError, TypeError, AttributeError):
        raise ValueError(f"bad verifier URL {url!r}: expected tcp://HOST:PORT") from None
    if parts.scheme != "tcp" or not parts.hostname or port is None or parts.path not in ("", "/"):
        raise ValueError(f"bad verifier URL {url!r}: expected tcp://HOST:PORT (or http://HOST:PORT for vLLM)")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"tcp://{host}:{port}"


# ---- errors the drafter falls back on -------------------------------------------------------------
class VerifierError(RuntimeError):
    """The verifier cannot be used for this request (the drafter finishes it locally)."""


class VerifierUnavailable(VerifierError):
    """Down, unreachable, or no answer in time."""


class VerifierRefused(VerifierError):
    """The verifier answered with a Failure."""

    def __init__(self, failure: Failure):
        super().__init__(f"verifier refused the call ({failure.code}): {failure.message}")
        self.failure = failure


class BadAnswer(VerifierError):
    """An answer that does not decode or does not fit the call."""


# ---- the drafter's client ----------------------------------------------------------------------------
class ZmqVerifier:
    """One DEALER socket to the verifier; one call in flight at a time (`send`, then `poll` between draft
    steps). Answers to earlier calls (one that timed out, say) are dropped by (request, seq). A call in
    flight fails at once (VerifierUnavailable) when the connection it went out on ends: the verifier died,
    or its host stopped answering heartbeats; a new connection would not know the call."""

    cheap_calls = True  # a call costs the verifier one short forward over a resident KV (drafter.py)

    def __init__(
        self,
        url: str,
        token: bytes,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        connect_timeout_s: float = 1.0,
        keys=FROM_ENV,
        heartbeat_s: float = HEARTBEAT_S,
    ):
        import zmq

        from . import auth

        self.url, self.endpoint, self.timeout_s = url, zmq_endpoint(url), timeout_s
        keys = auth.client_keys() if keys == FROM_ENV else keys  # before any socket: a missing key fails here
        if keys is None:
            logger.warning("verifier %s: no CURVE keys (%s=1): calls travel in clear", url, auth.INSECURE_ENV)
        self.connect_timeout_s = connect_timeout_s
        self._token, self._zmq = token, zmq
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        auth.secure_client(self._sock, keys)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only on a live connection: a dead verifier fails fast
        self._sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_ANSWER_BYTES)
        ms = max(1, int(heartbeat_s * 1000))
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, ms)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * ms)
        self._sock.setsockopt(zmq.HEARTBEAT_TTL, 3 * ms)  # the verifier drops us when we go silent
        self._mon = self._sock.get_monitor_socket(
            zmq.EVENT_DISCONNECTED
            | zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        )
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._mon, zmq.POLLIN)
        self._sock.connect(self.endpoint)
        self._expect: tuple[str, int] | None = None
        self._lost: str | None = None  # why the connection of the call in flight ended
        self._refused: str | None = None  # the last handshake failure, for the "not reachable" message
        self.deadline, self.waits_s = 0.0, timeout_s

    def __repr__(self) -> str:
        return f"<ZmqVerifier {self.url}>"  # never the token

    def _events(self, armed: bool) -> None:
        """Read the socket's connection events; armed: a call is in flight, and a disconnect loses it."""
        from zmq.utils.monitor import recv_monitor_message

        zmq = self._zmq
        while self._mon.poll(0):
            e = recv_monitor_message(self._mon)
            kind = e["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._refused = None
            elif kind == zmq.EVENT_DISCONNECTED:
                if armed:
                    self._lost = "the connection ended (verifier down, or its host silent for 3 heartbeats)"
            else:
                auth_failed = kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH
                self._refused = (
                    "the verifier refused this drafter's CURVE key"
                    if auth_failed
                    else f"handshake failed ({kind.name})"
                )

    def send(self, call: Call, timeout_s: float | None = None) -> None:
        """Queue the call; VerifierUnavailable when no connection comes up within connect_timeout_s."""
        zmq = self._zmq
        frames = call_frames(self._token, call)
        self._events(armed=False)  # what happened before this call does not concern it
        try:
            self._sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:  # not connected (yet): wait for the connection, once
            self._wait_connected()
            try:
                self._sock.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:
                raise VerifierUnavailable(self._unreachable()) from None
            self._events(armed=False)  # the reconnection's own events
        self._lost = None
        if isinstance(call, Verify):
            self._expect = (call.request, call.seq)
        elif isinstance(call, Stats):
            self._expect = ("", -1)
        self.waits_s = self.timeout_s if timeout_s is None else timeout_s
        self.deadline = time.monotonic() + self.waits_s

    def _wait_connected(self) -> None:
        zmq = self._zmq
        end = time.monotonic() + self.connect_timeout_s
        while (left := end - time.monotonic()) > 0:
            if self._sock.poll(int(min(left, 0.05) * 1000) + 1, zmq.POLLOUT):
                return
            self._events(armed=False)
            if self._refused is not None and "CURVE key" in self._refused:
                break  # it will not admit us: no use waiting
        raise VerifierUnavailable(self._unreachable())

    def _unreachable(self) -> str:
        why = f": {self._refused}" if self._refused else ""
        return f"verifier {self.url} is not reachable{why}"

    def poll(self, wait_s: float = 0.0) -> Answer | None:
        """The answer to the call in flight, or None if it has not come within wait_s (raises
        VerifierUnavailable once the call's deadline has passed or its connection ended, VerifierRefused on
        a Failure, BadAnswer on garbage)."""
        zmq = self._zmq
        end = time.monotonic() + wait_s
        while True:
            left = min(end, self.deadline) - time.monotonic()
            ready = dict(self._poller.poll(max(0, int(left * 1000)) if left > 0 else 0))
            if ready.get(self._sock, 0) & zmq.POLLIN:  # an answer that came before a disconnect counts
                answer = self._read()
                if answer is not None:
                    return answer
                continue
            if ready.get(self._mon):
                self._events(armed=self._expect is not None)
                if self._lost is not None and self._expect is not None:
                    self._expect = None
                    raise VerifierUnavailable(f"verifier {self.url}: {self._lost} while a call was in flight")
                continue
            if time.monotonic() >= self.deadline:
                self._expect = None
                raise VerifierUnavailable(f"verifier {self.url}: no answer within {self.waits_s}s")
            if time.monotonic() >= end:
                return None

    def _read(self) -> Answer | None:
        frames = self._sock.recv_multipart(self._zmq.NOBLOCK)
        if len(frames) != 1:
            raise BadAnswer(f"verifier {self.url} sent {len(frames)} frames, expected 1")
        try:
            answer = decode_answer(frames[0])
        except ValueError as e:
            raise BadAnswer(f"verifier {self.url}: {e}") from None
        if self._expect is None:
            return None  # a late answer to an abandoned call
        if isinstance(answer, Usage):
            return answer if self._expect == ("", -1) else None
        if isinstance(answer, Failure) and answer.request == "":
            raise VerifierRefused(answer)  # one call in flight: the unreadable one was ours
        if (answer.request, answer.seq) != self._expect:
            return None  # an answer to an earlier call
        if isinstance(answer, Failure):
            raise VerifierRefused(answer)
        return answer

    def call(self, call: Call, timeout_s: float | None = None) -> Answer:
        """send + wait (stats, tests)."""
        self.send(call, timeout_s)
        while True:
            got = self.poll(3600)
            if got is not None:
                return got

    def release(self, request: str) -> None:
        """Best effort: free the request's state now (the verifier's TTL frees it anyway)."""
        try:
            self._sock.send_multipart(call_frames(self._token, Release(request)), self._zmq.NOBLOCK)
        except self._zmq.ZMQError:
            pass
        self._expect = None

    def close(self) -> None:
        try:
            self._sock.disable_monitor()
        except self._zmq.ZMQError:
            pass
        self._mon.close(0)
        self._sock.close(0)
