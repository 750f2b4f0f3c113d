"""How many requests an ingestion keeps unanswered: enough to keep the server busy, and no more.

A fixed window of requests in flight either leaves the server idle (too few) or stacks a backlog in
its queue (too many), where it delays everyone else's requests and buys the ingestion nothing. The
window here adapts as TCP Vegas adapts a connection's: the fastest answer seen is what a request
costs with nothing ahead of it; a slower answer means requests are waiting in the server's queue,
about `window x (1 - fastest / latest)` of them. Once a round (a window's worth of answers), the
window grows by one while fewer than `QUEUED_LOW` wait, and shrinks by one while more than
`QUEUED_HIGH` do, between 1 and its limit.
"""

from __future__ import annotations

import asyncio
import math

QUEUED_LOW = 1.0
"""Fewer requests than this waiting in the server's queue: the window grows (the server may go idle)."""
QUEUED_HIGH = 3.0
"""More requests than this waiting in the server's queue: the window shrinks (a backlog buys nothing)."""
START = 2
"""Requests a new window lets out before any answer has come back."""


class AdaptiveWindow:
    """A bound on requests in flight that follows the wait the server's answers show (see the module)."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("a window's limit must be at least 1")
        self.limit = limit
        self.size = min(START, limit)
        """Requests it lets out now."""
        self._out = 0
        self._fastest_s = math.inf
        self._answers_this_round = 0
        self._changed = asyncio.Event()

    async def acquire(self) -> None:
        """Wait until the window has room for one more request, and take it."""
        while self._out >= self.size:
            self._changed.clear()
            await self._changed.wait()
        self._out += 1

    def release(self, latency_s: float | None = None) -> None:
        """A request left the window: answered after `latency_s` seconds, or (None) not answered (sent again)."""
        self._out -= 1
        if latency_s is not None and latency_s > 0:
            self._observe(latency_s)
        self._changed.set()

    def _observe(self, latency_s: float) -> None:
        self._fastest_s = min(self._fastest_s, latency_s)
        self._answers_this_round += 1
        if self._answers_this_round < self.size:
            return
        self._answers_this_round = 0
        queued = self.size * (1 - self._fastest_s / latency_s)
        if queued < QUEUED_LOW:
            self.size = min(self.limit, self.size + 1)
        elif queued > QUEUED_HIGH:
            self.size = max(1, self.size - 1)
