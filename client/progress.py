"""An ingestion's progress: a bar redrawn in place on a terminal, a plain line now and then otherwise, a summary."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TextIO

BAR_WIDTH = 30
TERMINAL_INTERVAL_S = 0.2
LOG_INTERVAL_S = 10.0


class Progress:
    """Rows done of `total` (`skipped` of them finished by an earlier run), their rate, the ETA and the retries.

    A row is one of `unit` (texts, images). Tokens are the server's count (each answer's `prompt_tokens`
    parameter), shown once it gives one. `stream` None: silent (--quiet), the summary included.
    """

    def __init__(
        self,
        total: int,
        skipped: int,
        stream: TextIO | None,
        calls_retried: Callable[[], int] = lambda: 0,
        *,
        unit: str = "texts",
        interval_s: float | None = None,
    ) -> None:
        self.total = total
        self.unit = unit
        self.skipped = skipped
        self.done = 0
        """Rows embedded by this run."""
        self.tokens = 0
        """Their tokens, as the server counted them (0 where it does not say)."""
        self.resent = 0
        """Requests sent again because a stream ended before answering them, or answered them with an error."""
        self._calls_retried = calls_retried
        self._stream = stream
        self._terminal = stream is not None and stream.isatty()
        self._interval_s = interval_s or (TERMINAL_INTERVAL_S if self._terminal else LOG_INTERVAL_S)
        self._started = time.monotonic()
        self._shown = self._started

    @property
    def retries(self) -> int:
        """Requests sent again: calls retried after RESOURCE_EXHAUSTED or UNAVAILABLE, and stream requests resent."""
        return self.resent + self._calls_retried()

    @property
    def elapsed_s(self) -> float:
        """Seconds since this run began."""
        return time.monotonic() - self._started

    @property
    def rate(self) -> float:
        """Rows embedded per second by this run."""
        return self.done / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def token_rate(self) -> float:
        """Tokens embedded per second by this run."""
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def _tokens_per_s(self) -> str:
        return f", {self.token_rate:.0f} tokens/s" if self.tokens else ""

    def advance(self, rows: int, tokens: int = 0) -> None:
        """Count rows done (and their tokens); show the progress if it is time."""
        self.done += rows
        self.tokens += tokens
        now = time.monotonic()
        if self._stream is not None and now - self._shown >= self._interval_s:
            self._shown = now
            self._show()

    def _line(self) -> str:
        finished = self.skipped + self.done
        left = self.total - finished
        eta = f"{left / self.rate:.0f} s" if self.rate > 0 else "?"
        rates = f"{self.rate:.0f} {self.unit}/s{self._tokens_per_s()}"
        return f"{finished}/{self.total} {self.unit}, {rates}, ETA {eta}, {self.retries} retries"

    def _show(self) -> None:
        assert self._stream is not None
        if self._terminal:
            filled = BAR_WIDTH * (self.skipped + self.done) // max(self.total, 1)
            self._stream.write(f"\r[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {self._line()}\x1b[K")
        else:
            self._stream.write(self._line() + "\n")
        self._stream.flush()

    def summary(self) -> str:
        """One line: what this run did."""
        resumed = f" ({self.skipped} done by an earlier run)" if self.skipped else ""
        return (
            f"embedded {self.done} {self.unit} in {self.elapsed_s:.1f} s"
            f" ({self.rate:.0f} {self.unit}/s{self._tokens_per_s()})"
            f"{resumed},"
            f" {self.retries} retries; {self.skipped + self.done}/{self.total} rows written"
        )

    def finish(self) -> None:
        """Show the summary (ending the bar's line on a terminal)."""
        if self._stream is not None:
            self._stream.write(("\r\x1b[K" if self._terminal else "") + self.summary() + "\n")
            self._stream.flush()
