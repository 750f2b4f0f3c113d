"""The HTTP listener: uvicorn (httptools) serving the ASGI app in the server's own event loop."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Iterator

import uvicorn

from service.frontends.http.app import HttpApp

BACKLOG = 2048


def _listening_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    """A bound, listening TCP socket (OSError if the address is taken; shared with other processes if `reuse_port`).

    Made with protocol IPPROTO_TCP, not socket.create_server's 0: asyncio turns Nagle's algorithm
    off (TCP_NODELAY) on accepted connections only when the listener's protocol says TCP, and
    with it on, a response written as head then body waits for the client's delayed ACK (40 ms).
    """
    family, kind, protocol, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP, flags=socket.AI_PASSIVE
    )[0]
    listening = socket.socket(family, kind, protocol)
    try:
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        listening.bind(address)
        listening.listen(BACKLOG)
    except OSError:
        listening.close()
        raise
    return listening


class _EmbeddedServer(uvicorn.Server):
    """uvicorn's server, without its signal handlers: the service's own handlers drain every port at once."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.listening = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Leave SIGTERM and SIGINT to the service."""
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """Start serving, then tell start() so."""
        await super().startup(sockets)
        self.listening.set()


class HttpListener:
    """The HTTP port: bound by start(), drained by stop() (open requests finish, idle connections close)."""

    def __init__(
        self, app: HttpApp, host: str, port: int, tls: ssl.SSLContext | None, reuse_port: bool = False
    ) -> None:
        self._app = app
        self._reuse_port = reuse_port
        self._host = host
        self._requested_port = port
        self._tls = tls
        self._server: _EmbeddedServer | None = None
        self._task: asyncio.Task[None] | None = None
        self.port = 0

    async def start(self) -> None:
        """Bind (OSError if the port is taken) and serve in the background."""
        listening = _listening_socket(self._host, self._requested_port, self._reuse_port)
        self.port = listening.getsockname()[1]
        tls = self._tls
        config = uvicorn.Config(
            self._app,
            http="httptools",
            ws="none",
            lifespan="off",
            log_config=None,  # the service's logging as configured; uvicorn only tells of trouble
            log_level="warning",
            access_log=False,
            server_header=False,
            proxy_headers=False,
            ssl_context_factory=(lambda config, default: tls) if tls is not None else None,
        )
        self._server = _EmbeddedServer(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[listening]))
        started = asyncio.ensure_future(self._server.listening.wait())
        await asyncio.wait((started, self._task), return_when=asyncio.FIRST_COMPLETED)
        if not started.done():
            started.cancel()
            listening.close()
            await self._task  # raises what stopped it, if anything did
            raise OSError(f"the HTTP server on {self._host}:{self.port} stopped while starting")

    async def stop(self, grace_s: float) -> None:
        """Stop accepting, let open requests finish for up to grace_s, then close every connection."""
        if self._server is None or self._task is None:
            return
        self._server.config.timeout_graceful_shutdown = max(1, round(grace_s))
        self._server.should_exit = True
        await self._task
