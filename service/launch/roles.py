"""One process's role, once `python -m service` has its settings: the whole server, the engine, or front end N."""

from __future__ import annotations

import asyncio
import sys

import uvloop

from service.core.engine_process import run_engine
from service.core.repository import RepositoryError
from service.errors import ExecutionError
from service.launch import processes
from service.launch.server import FrontendRole, serve
from service.ops import tracing
from service.ops.security import SecurityError
from service.ops.settings import Settings, SettingsError


def run_role(role: str, settings: Settings) -> int:
    """Serve a role until signalled; a configuration problem is one line and exit 2."""
    try:
        tracing.configure(settings, role)  # each process its own tracer provider (or none: off)
    except SettingsError as error:
        print(f"service: error: {error}", file=sys.stderr)
        return 2
    try:
        # uvloop: less server CPU per gRPC call than asyncio's own loop (docs/decisions.md#uvloop).
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(_serve(role, settings))
    except (RepositoryError, ExecutionError, SecurityError, OSError) as error:
        print(f"service: error: {error}", file=sys.stderr)
        return 2
    finally:
        tracing.shutdown()


async def _serve(role: str, settings: Settings) -> int:
    """Run one role until signalled: the whole server, the engine, or front end N."""
    if role == "engine":
        return await run_engine(settings, str(processes.runtime_folder() / processes.ENGINE_SOCKET))
    if role.startswith("frontend"):
        index = int(role.rsplit(maxsplit=1)[-1])
        return await serve(settings, FrontendRole(index, str(processes.runtime_folder() / processes.ENGINE_SOCKET)))
    return await serve(settings)
