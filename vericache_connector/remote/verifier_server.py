"""`vericache verifier`: the verifier service next to the store, serving many drafters over ZMQ (rpc.py).

    VERICACHE_VERIFIER_TOKEN_FILE=/run/secrets/verifier/token \\
    VERICACHE_VERIFIER_SECRET_KEY_FILE=/run/secrets/verifier/secret-key \\
    VERICACHE_VERIFIER_CLIENT_KEYS_FILE=/run/secrets/verifier/client-keys \\
    vericache verifier --store redis://vericache-redis:6379/0 --model DIR --host 0.0.0.0 --port 8477

One thread runs the loop: drain every call that has arrived (a forward's worth, from all drafters), check
and refuse what does not fit (a Failure answer names why; the loop goes on), start the full-KV load of a
request the first time it is seen (on the StoreClient's loop thread, over the fast link, while the loop
goes on serving others), then verify every request whose KV is in, batched (verifier.py), and answer.
A request's calls are answered in order; a resident not used for ttl_s is freed (its drafter died), and a
Release frees it at once. The store URL may carry a password: it comes from --store or $VERICACHE_STORE_URL
(a Secret) and is only ever shown redacted.

Only drafters whose CURVE keys it was given get a call through (auth.py: the keys; gate.py: the socket and
the handshake, before any call is read), frames are small, open connections are capped, and each peer's
calls waiting for an answer are capped in bytes (a Failure "busy" beyond). Refusals are logged at a bounded
rate, request ids escaped (peer_log.py).

--metrics-port serves Prometheus metrics over HTTP (verifier_metrics.py: requests, verify calls, accepted drafts
per call, queue length, fallbacks, auth failures; docs/operations.md#metrics); off by default, on in k8s/.
"""

from __future__ import annotations

import hmac
import logging
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass

from storage_backends import redact_url

from ..metrics import serve_metrics
from ..store.client import StoreClient
from ..store.full_copy import stream_full_copy
from . import rpc
from .cli_args import store_config
from .gate import close_socket, open_socket
from .peer_log import LogLimiter, esc
from .verifier import CallError, Resident, VerifierConfig, VerifierCore
from .verifier_metrics import VerifierMetrics

logger = logging.getLogger("vericache.verifier")


@dataclass
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = rpc.DEFAULT_PORT  # 0: any free port (printed)
    max_call_bytes: int = rpc.MAX_CALL_BYTES
    idle_poll_s: float = 0.05
    max_connections: int = 256  # admitted drafter connections; one beyond is closed at once (gate.Gate)
    max_pending: int = 64  # connections not admitted yet (no key shown); one more evicts the oldest (gate.Gate)
    max_pending_per_address: int = 8  # of those, from one source address
    max_pending_bytes: int | None = None  # per peer: its calls not yet answered (None: 2 x max_call_bytes)
    handshake_s: float = 5.0  # a connection without a finished handshake by then is closed
    heartbeat_s: float = 2.0  # pings; a drafter silent for 3x this is dropped
    log_window_s: float = 10.0  # refusals of one kind: 3 lines per window, the rest summed up (peer_log.LogLimiter)
    metrics_port: int | None = None  # Prometheus metrics over HTTP on host:metrics_port (0: any free port; None: off)

    def __post_init__(self):
        for name in ("max_call_bytes", "max_connections", "max_pending", "max_pending_per_address", "handshake_s",
                     "heartbeat_s", "log_window_s"):  # fmt: skip
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.max_pending_bytes is None:
            self.max_pending_bytes = 2 * self.max_call_bytes
        if self.max_pending_bytes < self.max_call_bytes:
            raise ValueError(f"max_pending_bytes ({self.max_pending_bytes}) must be >= max_call_bytes")


class VerifierServer:
    """keys: auth.ServerKeys (CURVE), None (no CURVE: calls in clear, a test setup), or rpc.FROM_ENV."""

    def __init__(
        self, core: VerifierCore, store: StoreClient, token: bytes, settings: ServerSettings | None = None, keys=None
    ):
        import zmq

        from . import auth

        self.core, self.store, self.settings = core, store, settings or ServerSettings()
        st = self.settings
        keys = auth.server_keys() if keys == rpc.FROM_ENV else keys
        self._token, self._zmq = token, zmq
        self._ctx = zmq.Context()  # its own: the ZAP handler's endpoint is one per context
        self.limit = LogLimiter(logger, st.log_window_s)
        self._sock, self.gate, self.port = open_socket(self._ctx, st, keys, self.limit)
        self.queues: dict[str, deque] = {}  # request -> calls waiting, in order: (peer, Verify, bytes)
        self.pending: dict[bytes, int] = {}  # peer -> bytes of its calls waiting
        self.loading: dict[str, tuple[Resident, object, float]] = {}  # request -> (resident, future, t0)
        self.failures: dict[str, int] = {}
        self.stop = threading.Event()
        self.metrics = VerifierMetrics(self)
        self.metrics_server = None if st.metrics_port is None else serve_metrics(self.metrics, st.host, st.metrics_port)

    # ---- the loop ----------------------------------------------------------------------------------
    def serve_forever(self) -> None:
        last_sweep = time.monotonic()
        try:
            while not self.stop.is_set():
                ready = self._ready()
                wait = 0 if ready else (0.005 if self.loading else self.settings.idle_poll_s)
                if self._sock.poll(int(wait * 1000)):
                    self._drain()
                    ready = self._ready()
                self._run(ready)
                if time.monotonic() - last_sweep > 1.0:
                    last_sweep = time.monotonic()
                    for name in self.core.expire(last_sweep, set(self.loading)):
                        logger.info("request %s: idle for over %ss, its KV is freed", esc(name), self.core.cfg.ttl_s)
                    self.limit.flush()
        finally:
            if self.metrics_server is not None:
                self.metrics_server.close()
            close_socket(self._ctx, self._sock, self.gate)

    def _drain(self) -> None:
        zmq = self._zmq
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            peer, rest = frames[0], frames[1:]
            try:
                self._take(peer, rest)
            except CallError as e:
                self._fail(peer, "", -1, e.code, str(e))

    def _take(self, peer: bytes, frames: list[bytes]) -> None:
        f = rpc.FRAME_BYTES
        if len(frames) < 2 or any(len(p) != f for p in frames[1:-1]) or len(frames[-1]) > f:
            raise CallError(
                "malformed",
                f"a call is 2 frames [token, body] (a body over {f} bytes: in frames of {f}, the last one "
                f"shorter), got {len(frames)} frames",
            )
        if not hmac.compare_digest(frames[0], self._token):
            raise CallError("auth", "missing or wrong verifier token")
        size = sum(len(p) for p in frames[1:])
        if size > self.settings.max_call_bytes:
            raise CallError("too_large", f"call of {size} bytes exceeds the limit of {self.settings.max_call_bytes}")
        try:
            call = rpc.decode_call(frames[1] if len(frames) == 2 else b"".join(frames[1:]))
        except ValueError as e:
            raise CallError("malformed", str(e)) from None
        if isinstance(call, rpc.Stats):
            self._answer(
                peer, self.core.usage({**self.failures, **{f"gate_{k}": v for k, v in self.gate.counts.items()}})
            )
        elif isinstance(call, rpc.Release):
            for item in self.queues.pop(call.request, ()):
                self._done(item)
            if self.core.drop(call.request):
                self.core.counts["released"] += 1
        else:
            try:
                self.core.check(call)
                waiting = self.pending.get(peer, 0)
                if waiting + size > self.settings.max_pending_bytes:
                    raise CallError(
                        "busy",
                        f"this drafter has {waiting} bytes of calls waiting, the limit is "
                        f"{self.settings.max_pending_bytes}: try later",
                    )
            except CallError as e:
                self._fail(peer, call.request, call.seq, e.code, str(e))
                return
            self.pending[peer] = waiting + size
            self.queues.setdefault(call.request, deque()).append((peer, call, size))

    def _done(self, item: tuple[bytes, rpc.Verify, int]) -> None:
        """A queued call leaves the queue (answered, failed or dropped): its bytes stop counting."""
        peer, _, size = item
        left = self.pending.get(peer, 0) - size
        if left > 0:
            self.pending[peer] = left
        else:
            self.pending.pop(peer, None)

    def _ready(self) -> list[tuple[bytes, rpc.Verify, Resident]]:
        """The head call of every request whose KV is in; starts loads, finishes the ones that are done."""
        for name in [n for n, (_, fut, _) in self.loading.items() if fut.done()]:
            self._loaded(name)
        ready = []
        for name, queue in list(self.queues.items()):
            if not queue or name in self.loading:
                continue
            peer, call, _ = queue[0]
            r = self.core.resident(call)
            if r is not None and r.ready:
                ready.append((peer, call, r))
                continue
            try:
                r = self.core.admit(call, set(self.loading) | {c.request for _, c, _ in ready})
            except CallError as e:
                self._done(queue.popleft())
                self._fail(peer, call.request, call.seq, e.code, str(e))
                continue
            self.loading[name] = (r, self.store.submit(self._load(call.prompt[: call.stored], r)), time.monotonic())
        return ready

    async def _load(self, prefix: list[int], r: Resident) -> int:
        n, cache = len(prefix), r.cache

        def put(layer, k, v):
            cache.keys[layer][0, :, :n] = k
            cache.values[layer][0, :, :n] = v

        shape = cache.keys[0][0, :, :n].shape
        return await stream_full_copy(self.store.store, prefix, len(cache.keys), self.store.cfg.timeout_s, put, shape)

    def _loaded(self, name: str) -> None:
        r, fut, t0 = self.loading.pop(name)
        try:
            nbytes = fut.result()
        except Exception as e:  # store down, entry gone or corrupt: every waiting call is told
            if self.core.residents.get(name) is r:
                self.core.drop(name)
            logger.warning("request %s: full KV not loaded (%s: %s)", esc(name), type(e).__name__, e)
            for item in self.queues.pop(name, ()):
                self._done(item)
                peer, call, _ = item
                self._fail(peer, call.request, call.seq, "store", f"full KV not loaded: {type(e).__name__}: {e}")
            return
        if self.core.residents.get(name) is not r:
            return  # released or expired while loading
        r.ready, r.tokens = True, list(r.prefix)
        r.cache.lengths[0] = len(r.prefix)
        self.metrics.load_seconds.observe(time.monotonic() - t0)
        logger.info(
            "request %s: %d tokens of full KV loaded (%d bytes, %.3fs)",
            esc(name),
            len(r.prefix),
            nbytes,
            time.monotonic() - t0,
        )

    def _run(self, ready: list[tuple[bytes, rpc.Verify, Resident]]) -> None:
        """Verify the ready calls: short feeds batched up to max_batch rows, long ones alone."""
        cfg = self.core.cfg
        small, big = [], []
        for x in ready:
            (small if len(self.core.plan(x[1], x[2])[1]) <= cfg.batch_max_feed else big).append(x)
        batches = [small[i : i + cfg.max_batch] for i in range(0, len(small), cfg.max_batch)] + [[x] for x in big]
        for batch in batches:
            for _, call, _ in batch:
                self._done(self.queues[call.request].popleft())
            try:
                t0 = time.perf_counter()
                verdicts = self.core.verify([(call, r) for _, call, r in batch])
                self.metrics.verified(batch, verdicts, time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 - answer the calls, keep serving
                logger.exception("verify forward failed")
                for peer, call, r in batch:
                    self.core.drop(call.request)
                    self._fail(peer, call.request, call.seq, "internal", f"{type(e).__name__}: {e}")
                continue
            for (peer, _, _), verdict in zip(batch, verdicts):
                self._answer(peer, verdict)
        for name in [n for n, q in self.queues.items() if not q]:
            del self.queues[name]

    # ---- answers ----------------------------------------------------------------------------------
    def _answer(self, peer: bytes, answer) -> None:
        try:
            self._sock.send_multipart([peer, rpc.encode(answer)], self._zmq.NOBLOCK)
        except self._zmq.ZMQError:
            pass  # the drafter is gone; its resident expires

    def _fail(self, peer: bytes, request: str, seq: int, code: str, message: str) -> None:
        self.failures[code] = self.failures.get(code, 0) + 1
        of = f" of request {esc(request, 64)}" if request else ""
        self.limit(f"refused calls ({code})", "refused a call%s: %s: %s", of, code, esc(message, 500))
        self._answer(peer, rpc.Failure(request, seq, code, message))


def main(args) -> int:
    """The CLI entry (cli.py `verifier`): load the model, connect to the store, serve until SIGTERM/SIGINT."""
    from ..engine import VeriCacheEngine
    from . import auth

    token = rpc.verifier_token(args.token_file)  # before anything slow: a missing token or key fails at once
    keys = auth.server_keys()
    logger.setLevel(logging.INFO)  # loads, expiries and refusals are the service's log
    store_cfg = store_config(args)
    engine = VeriCacheEngine.from_pretrained(args.model)
    warm_s = engine.warm_up()  # full-KV forwards, before it serves: the first calls do not pay one-time costs
    core = VerifierCore(
        engine.model,
        engine.model_name,
        VerifierConfig(
            memory_bytes=int(args.memory_gb * (1 << 30)),
            ttl_s=args.ttl_s,
            max_batch=args.max_batch,
            chunk_size=args.chunk_size,
        ),
    )
    store = StoreClient(store_cfg, engine.model_name, engine.model.dtype, "vericache-verifier-store")
    settings = ServerSettings(
        args.host,
        args.port,
        args.max_call_bytes,
        max_connections=args.max_connections,
        max_pending=args.max_pending,
        max_pending_per_address=args.max_pending_per_address,
        metrics_port=args.metrics_port,
    )
    server = VerifierServer(core, store, token, settings, keys)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.stop.set())
    print(
        f"vericache verifier: serving {engine.model_name} on tcp://{args.host}:{server.port} "
        f"(store {redact_url(store_cfg.url)}, KV budget {args.memory_gb:g} GiB, "
        f"{'CURVE, ' + str(len(keys.clients)) + ' drafter keys' if keys else 'NO CURVE: calls in clear'}, "
        f"at most {settings.max_connections} drafter connections + {settings.max_pending} without a key yet; "
        f"warmed up in {warm_s:.1f}s)",
        flush=True,
    )
    if server.metrics_server is not None:
        print(f"vericache verifier: metrics on http://{args.host}:{server.metrics_server.port}/metrics", flush=True)
    try:
        server.serve_forever()
    finally:
        store.close()
    return 0
