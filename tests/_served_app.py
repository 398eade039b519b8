"""A helper the HTTP tests share: an ASGI app served by uvicorn in this process."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import uvicorn

__all__ = ["served"]


@contextlib.asynccontextmanager
async def served(
    app: Any = None, *, make_app: Callable[[Callable[[], bool]], Any] | None = None, **config: Any
) -> AsyncIterator[str]:
    """`app` served by uvicorn in this process on a free loopback port (`config`: more
    `uvicorn.Config` options); yields its URL, ``https`` when `config` has ``ssl_certfile``.

    With `make_app` instead of `app`, the app is ``make_app(stopping)``, where ``stopping()``
    says whether the server is shutting down.

    Raises:
        AssertionError: uvicorn stopped before it served.
        TimeoutError: it did not serve, or did not stop, within 10 s.
    """
    # proto TCP: asyncio sets TCP_NODELAY on the accepted sockets (else Nagle: +40 ms a call)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    servers: list[uvicorn.Server] = []
    if make_app is not None:
        app = make_app(lambda: servers[0].should_exit)
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, lifespan="on", **config))
    servers.append(server)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        with anyio.fail_after(10):
            while not server.started:
                if task.done():
                    task.result()
                    raise AssertionError("uvicorn stopped before it served")
                await asyncio.sleep(0.01)
        scheme = "https" if "ssl_certfile" in config else "http"
        yield f"{scheme}://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        with anyio.fail_after(10):
            await task
        sock.close()
