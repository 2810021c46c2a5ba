"""`vericache router` in this process, on a thread of its own (tests), and a TCP proxy on 127.0.0.1 that makes
an upstream server slow or cut its answers short (the faults the router must survive).

    with RouterThread(RouterConfig(verifiers=[...], drafters=[...]), token) as url:  # http://127.0.0.1:PORT
        ...
    with TcpProxy(port, delay_s=5) as proxied_port: ...
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


class TcpProxy:
    """127.0.0.1:port -> 127.0.0.1:target. delay_s: each chunk of the answer waits this long first;
    cut_sse_after: close a connection once its answer carried this many bytes after its first `data: `
    (a streamed completion dies mid-stream; other answers pass whole)."""

    def __init__(self, target: int, delay_s: float = 0.0, cut_sse_after: int | None = None):
        self.target, self.delay_s, self.cut = target, delay_s, cut_sse_after
        self.cuts = 0

    def __enter__(self) -> int:
        self._t = _LoopThread("tcp-proxy")

        async def start():
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            return self._server.sockets[0].getsockname()[1]

        return self._t.run(start())

    def __exit__(self, *exc) -> None:
        async def stop():
            self._server.close()

        self._t.run(stop())
        self._t.stop()

    async def _handle(self, reader, writer) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.close()
            return

        async def pipe(src, dst, answer: bool) -> None:
            sent = None  # bytes of the answer since its first `data: `
            try:
                while data := await src.read(65536):
                    if answer and self.delay_s:
                        await asyncio.sleep(self.delay_s)
                    if answer and self.cut is not None:
                        if sent is None and b"data: " in data:
                            sent = len(data) - data.index(b"data: ")
                        elif sent is not None:
                            sent += len(data)
                        if sent is not None and sent > self.cut:
                            self.cuts += 1
                            break
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                for w in (dst, writer, up_writer):
                    w.close()

        await asyncio.gather(pipe(reader, up_writer, False), pipe(up_reader, writer, True))
