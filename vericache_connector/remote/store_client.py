"""A DualCopyStore driven from synchronous code: its own event loop on a daemon thread.

Async clients (redis-py, aiobotocore-style sessions) are bound to the loop they were created on, so
every call of one store goes through this one loop. ``call`` waits (with a timeout that turns into
StoreUnavailable); ``submit`` returns a concurrent Future for work that runs on while the caller goes on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading

import torch

from storage_backends import DualCopyStore, StoreUnavailable, redact_url

from .config import RemoteCacheConfig


class StoreClient:
    def __init__(self, cfg: RemoteCacheConfig, model_name: str, dtype: torch.dtype, name: str = "vericache-store"):
        self.cfg = cfg
        self.store = DualCopyStore(
            cfg.url, model_name, dtype, cfg.chunk_size, cfg.bandwidth_bytes_per_s, timeout_s=cfg.timeout_s
        )
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro) -> concurrent.futures.Future:
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
        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                self.call(self.store.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
