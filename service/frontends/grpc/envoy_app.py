"""The ASGI application Envoy runs (service.frontends.grpc.envoy): one front end of a server of several.

Its lifespan starts the front end (service.server.InferenceServer, hosted: Envoy holds the gRPC port)
with the role and settings the supervisor gave it (service.processes), and every call to that port
goes to the front end's gRPC application. When its standard input closes (the
supervisor asks it to stop, or died) it drains: Envoy sends every connection GOAWAY, the front end
answers what it accepted, then Envoy exits.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
from functools import partial
from pathlib import Path

from service import processes
from service.frontends.grpc import envoy
from service.frontends.grpc.asgi import Receive, Scope, Send
from service.ops import tracing
from service.server import FrontendRole, InferenceServer

log = logging.getLogger(__name__)

_front_end: InferenceServer | None = None


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """Envoy's calls: the lifespan (start, stop), then each gRPC call."""
    if scope["type"] == "lifespan":
        await _lifespan(receive, send)
    elif _front_end is not None and _front_end.grpc_app is not None:
        await _front_end.grpc_app(scope, receive, send)


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await _start()
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _start() -> None:
    """Start the front end; a front end that cannot start ends Envoy's process (status 2, as a server)."""
    global _front_end  # noqa: PLW0603 - Envoy imports one application per process
    child = processes.child_settings()
    if child is None:
        sys.stderr.write("service: error: Envoy runs this application only as a front end of service.processes\n")
        os._exit(2)
    role, settings, runtime = child
    processes.prepare_child(role, runtime)
    processes.configure_logging(settings, role)
    index = int(role.rsplit(maxsplit=1)[-1])
    try:
        tracing.configure(settings, role)
        role_in_server = FrontendRole(index, str(runtime / processes.ENGINE_SOCKET))
        stop_listening = partial(envoy.admin, runtime, index, "/drain_listeners")
        _front_end = InferenceServer(settings, role_in_server, hosted_by=stop_listening)
        await _front_end.start()
    except Exception as error:
        sys.stderr.write(f"service: error: {error}\n")
        os._exit(2)
    loop = asyncio.get_running_loop()
    threading.Thread(target=_wait_for_stop, args=(loop, index, runtime), name="stop-watch", daemon=True).start()


def _wait_for_stop(loop: asyncio.AbstractEventLoop, index: int, runtime: Path) -> None:
    """Block until standard input closes, then drain on the event loop."""
    while os.read(0, 4096):
        pass
    asyncio.run_coroutine_threadsafe(_drain(index, runtime), loop).result()


async def _drain(index: int, runtime: Path) -> None:
    """The front end's drain (Envoy's listener closed, GOAWAY on every connection), then Envoy's exit."""
    assert _front_end is not None
    try:
        await _front_end.stop()
    except Exception:
        log.exception("the drain failed")
    finally:
        tracing.shutdown()
        await envoy.admin(runtime, index, "/quitquitquit")
