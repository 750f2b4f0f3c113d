"""Command line: `python -m service --model-repository DIR` (see --help for every setting)."""

from __future__ import annotations

import asyncio
import logging
import sys

import uvloop

from service.repository import RepositoryError
from service.runtime import ExecutionError
from service.server import serve
from service.settings import SettingsError, load_settings


def main(argv: list[str] | None = None) -> int:
    """Parse settings, serve until signalled; configuration problems are one line and exit 2."""
    try:
        settings = load_settings(argv)
    except SettingsError as error:
        print(f"service: error: {error}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        # uvloop: measured 65-110 us less server CPU per gRPC call than asyncio's own loop (README).
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(serve(settings))
    except (RepositoryError, ExecutionError, OSError) as error:
        print(f"service: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
