"""A model's queue in the engine process, as a front-end process uses it: the core behind a socket.

A front end's rows go to the engine through a `RemoteQueue`, its stand-in for the model's batcher:
the same `ModelQueue` contract (service.pipeline.models), admitted at the same one point, the
engine's batcher. A two-tower model has two: its text rows' and its image tower's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from service.core.rows import DEFAULT_SHARE, Rows, Share, WorkResult
from service.core.wire import EngineLink
from service.errors import Unavailable
from service.ops.tracing import to_wire

if TYPE_CHECKING:
    from opentelemetry.trace import SpanContext

log = logging.getLogger(__name__)


class RemoteQueue:
    """A model's queue in the engine process: rows go over the link; the queue bound is the engine's."""

    def __init__(self, link: EngineLink, model: str, version: str) -> None:
        self._link = link
        self._model = model
        self._version = version
        self._serving = True
        self._closing = False
        self._inflight = 0
        self.on_serving_change: Callable[[bool], None] | None = None

    def start(self) -> None:
        """Nothing to start here: the engine runs the model."""

    @property
    def serving(self) -> bool:
        """Whether the engine has an instance of the model in service."""
        return self._serving

    def set_serving(self, serving: bool) -> None:
        """The engine's word on whether the model has an instance in service."""
        if serving != self._serving:
            self._serving = serving
            if self.on_serving_change is not None:
                self.on_serving_change(serving)

    def check_room(self, priority: int = 0) -> None:
        """Refuse at once while draining or with no instance in service; takes no place (the engine's queue decides)."""
        if self._closing:
            raise Unavailable("the model is shutting down")
        if not self._serving:
            raise Unavailable("no model instance is in service (every one is stuck in an overlong run)", "no_instance")

    async def submit(
        self,
        rows: Rows,
        outputs: tuple[str, ...],
        deadline: float | None,
        trace: SpanContext | None = None,
        share: Share = DEFAULT_SHARE,
    ) -> WorkResult:
        """Send the rows to the engine, whose batcher admits or refuses them, and wait for their outputs.

        A caller that goes away cancels them there.

        `trace` (the request's span context) goes with them, for the span of the batch they run in.
        """
        wire = to_wire(trace)
        request_id, future = self._link.submit(
            self._model, self._version, rows, outputs, deadline, trace=wire, share=share
        )
        self._inflight += 1
        try:
            return await future
        except asyncio.CancelledError:
            self._link.cancel(request_id)
            raise
        finally:
            self._inflight -= 1

    def flush(self) -> None:
        """Ask the engine to run queued rows without waiting for fuller batches (it then does so for every model)."""
        self._link.drain()

    async def close(self, timeout_s: float) -> None:
        """Refuse new work and wait (up to timeout_s) until every request sent to the engine is answered."""
        self._closing = True
        deadline = time.monotonic() + timeout_s
        while self._inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
