"""`vericache router` in this process, on a thread of its own (tests); net.TcpProxy makes an upstream server
slow or cuts its answers short (the faults the router must survive).

    with RouterThread(RouterConfig(verifiers=[...], drafters=[...]), token) as url:  # http://127.0.0.1:PORT
        ...
"""

from __future__ import annotations

import asyncio
import threading


class _LoopThread:
    """An asyncio loop on a daemon thread; start(coro) runs coro there and returns its result."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro, timeout_s: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class RouterThread:
    def __init__(self, cfg, token: bytes | None):
        from vericache_connector.router.server import Router

        self.router = Router(cfg, token)

    def __enter__(self) -> str:
        from aiohttp import web

        from vericache_connector.router.server import make_app

        self._t = _LoopThread("router")

        async def start():
            self._runner = web.AppRunner(make_app(self.router))
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", 0).start()
            return self._runner.addresses[0][1]

        return f"http://127.0.0.1:{self._t.run(start())}"

    def __exit__(self, *exc) -> None:
        self._t.run(self._runner.cleanup())
        self._t.stop()
