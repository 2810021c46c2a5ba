"""A DualCopyStore driven from synchronous code: its own event loop on a daemon thread.

Async clients (redis-py, aiobotocore-style sessions) are bound to the loop they were created on, so
every call of one store goes through this one loop. ``call`` waits (with a timeout that turns into
StoreUnavailable); ``submit`` returns a concurrent Future for work that runs on while the caller goes on.

``close`` leaves nothing behind: it cancels what still runs on the loop (a full-copy stream, a write),
closes the store's connections, the loop's async generators and its default executor (the threads of
``asyncio.to_thread``), stops and joins the loop thread and closes the loop. It also runs at
interpreter exit for a client nobody closed. A closed client refuses work with ClientClosed at once
(it never waits out a timeout).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import weakref

import torch

from storage_backends import DualCopyStore, StoreUnavailable, redact_url
from storage_backends.credentials import read_secret_file, secret_from_env

from .config import RemoteCacheConfig

logger = logging.getLogger("vericache.remote")
CLOSE_TIMEOUT_S = 10.0  # cancelling, closing connections, joining the executor and the thread


def mac_key(cfg: RemoteCacheConfig) -> bytes | None:
    """The store's MAC key: cfg.mac_key_file, else $VERICACHE_MAC_KEY_FILE / $VERICACHE_MAC_KEY, else None."""
    if cfg.mac_key_file:
        return read_secret_file(cfg.mac_key_file, "MAC key")
    return secret_from_env("VERICACHE_MAC_KEY", what="MAC key")


class ClientClosed(RuntimeError):
    """Work submitted to a StoreClient after close()."""


class StoreClient:
    def __init__(self, cfg: RemoteCacheConfig, model_name: str, dtype: torch.dtype, name: str = "vericache-store"):
        self.cfg = cfg
        self.store = DualCopyStore(
            cfg.url,
            model_name,
            dtype,
            cfg.chunk_size,
            cfg.bandwidth_bytes_per_s,
            timeout_s=cfg.timeout_s,
            key_hashing=cfg.key_hashing,
            cache_salt=cfg.cache_salt,
            mac_key=mac_key(cfg),
        )
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()
        # Holds no reference to self: runs on close(), or at exit if close() was never called.
        self._close = weakref.finalize(self, _shut_down, self._loop, self._thread, self.store, redact_url(cfg.url))

    @property
    def closed(self) -> bool:
        return not self._close.alive

    def submit(self, coro) -> concurrent.futures.Future:
        if self.closed:
            coro.close()  # never scheduled: no "coroutine was never awaited" warning
            raise ClientClosed(f"store client for {redact_url(self.cfg.url)} is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def call(self, coro, timeout: float | None = None):
        timeout = self.cfg.timeout_s if timeout is None else timeout
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise StoreUnavailable(f"{redact_url(self.cfg.url)}: no answer within {timeout}s") from None

    def close(self) -> None:
        """Idempotent; see the module docstring."""
        self._close()


def _shut_down(loop: asyncio.AbstractEventLoop, thread: threading.Thread, store: DualCopyStore, where: str) -> None:
    if thread.is_alive():
        try:
            asyncio.run_coroutine_threadsafe(_drain(loop, store), loop).result(CLOSE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - closing must not raise; say what was left
            logger.warning("store client for %s did not shut down cleanly (%s: %s)", where, type(e).__name__, e)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(CLOSE_TIMEOUT_S)
    if not thread.is_alive() and not loop.is_closed():
        loop.close()


async def _drain(loop: asyncio.AbstractEventLoop, store: DualCopyStore) -> None:
    """On the loop: cancel every other task and wait for them, then close the store and the loop's
    async generators and default executor."""
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await store.close()
    await loop.shutdown_asyncgens()
    await loop.shutdown_default_executor()
