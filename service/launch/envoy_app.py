"""The ASGI application Envoy runs (service.launch.envoy): a front end, or the whole server.

Its lifespan starts service.launch.server.InferenceServer (hosted: Envoy holds the gRPC port) with the role
and settings the supervisor gave it (service.launch.processes): `frontend N` of a server of several, or
`server` (one front end: the engine in this process too, no socket between them). Every call to
that port goes to its gRPC application. When its standard input closes (the supervisor asks it to
stop, or died) it drains: Envoy sends every connection GOAWAY, the server answers what it accepted,
then Envoy exits.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from functools import partial
from pathlib import Path

from service.frontends.grpc.asgi import Receive, Scope, Send
from service.launch import envoy, processes
from service.launch.server import FrontendRole, InferenceServer
from service.ops import tracing

log = logging.getLogger(__name__)

_front_end: InferenceServer | None = None
_serving: asyncio.Task[None] | None = None
"""serve_models(), after Envoy's listener opened: loading the models, or connecting to the engine."""


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
    """Bind, then serve the models in the background (Envoy opens its listener when this returns).

    A server that cannot start ends Envoy's process (status 2, as a lone server).
    """
    global _front_end, _serving  # noqa: PLW0603 - Envoy imports one application per process
    child = processes.child_settings()
    if child is None:
        sys.stderr.write(
            "service: error: Envoy runs this application only as a front end of service.launch.processes\n"
        )
        os._exit(2)
    role, settings, runtime = child
    processes.prepare_child(role, runtime)
    processes.configure_logging(settings, role)
    index = processes.envoy_index(role)
    try:
        tracing.configure(settings, role)
        frontend = FrontendRole(index, str(runtime / processes.ENGINE_SOCKET)) if role != "server" else None
        stop_listening = partial(envoy.stop_listening, runtime, index)
        _front_end = InferenceServer(settings, frontend, hosted_by=stop_listening)
        await _front_end.bind()
    except Exception as error:
        _exit_unstarted(error)
    _serving = asyncio.create_task(_front_end.serve_models())
    _serving.add_done_callback(_served)
    loop = asyncio.get_running_loop()
    threading.Thread(target=_wait_for_stop, args=(loop, index, runtime), name="stop-watch", daemon=True).start()


def _exit_unstarted(error: BaseException) -> None:
    sys.stderr.write(f"service: error: {error}\n")
    os._exit(2)


def _served(task: asyncio.Task[None]) -> None:
    """The models are served, or could not be (the process ends, status 2), or the drain came first."""
    if not task.cancelled() and task.exception() is not None:
        _exit_unstarted(task.exception())


def _wait_for_stop(loop: asyncio.AbstractEventLoop, index: int, runtime: Path) -> None:
    """Block until standard input closes, then drain on the event loop."""
    while os.read(0, 4096):
        pass
    asyncio.run_coroutine_threadsafe(_drain(index, runtime), loop).result()


async def _drain(index: int, runtime: Path) -> None:
    """The front end's drain, then Envoy's exit once its connections are closed or had their final GOAWAY.

    Envoy's listener closes and every connection that carries a call is sent GOAWAY (envoy.stop_listening).
    """
    assert _front_end is not None and _serving is not None
    started = time.monotonic()
    try:
        if not _serving.done():
            _serving.cancel()
            await asyncio.gather(_serving, return_exceptions=True)
        await _front_end.stop()
        goaways_by = started + envoy.GOAWAY_GRACE_S + envoy.DELAYED_CLOSE_S
        await envoy.connections_closed(runtime, index, goaways_by, started + _front_end.settings.drain_timeout_s)
    except Exception:
        log.exception("the drain failed")
    finally:
        tracing.shutdown()
        await envoy.admin(runtime, index, "/quitquitquit")
