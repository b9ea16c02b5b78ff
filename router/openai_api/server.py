"""uvicorn in the router's event loop: started after the gRPC server, stopped before it.

uvicorn's ``Server.serve`` takes over SIGINT/SIGTERM; the router handles those itself
(it drains both APIs in order), so this server leaves them alone.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from tandem.common.tls import TLSFiles


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    def __init__(
        self, app: FastAPI, host: str, port: int, tls: TLSFiles | None, drain_s: float
    ) -> None:
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            lifespan="off",
            access_log=False,
            timeout_graceful_shutdown=max(1, int(drain_s)),
            ssl_certfile=None if tls is None else str(tls.certfile),
            ssl_keyfile=None if tls is None else str(tls.keyfile),
        )
        self._server = _Server(config)
        self._task: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        return self._server.servers[0].sockets[0].getsockname()[1]

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it (a port in use, ...)
                raise OSError("the HTTP server stopped at start")
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        """Stop taking connections, let the requests in flight finish (up to the drain)."""
        if self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
