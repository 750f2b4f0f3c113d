"""A model's measured speed: rows and tokens per second of run, averaged over its recent batches.

The batcher reads it to say how long the rows queued ahead of a new request take to run: the
expected wait a queue bound refuses past (`--max-queue-wait-ms`) and the `retry-after` of a refusal.
"""

from __future__ import annotations

from dataclasses import dataclass

LATEST_BATCH_WEIGHT = 0.2
"""Weight of the latest batch in the moving averages (an EWMA): about the last ten batches count."""


@dataclass(slots=True)
class Throughput:
    """Moving averages (EWMA) of a batch's rows, real tokens and run time; rates are their ratios.

    Averaging rows and seconds apart (rather than each batch's rate) weighs a batch by the time it
    took: one slow batch among fast ones lowers the rate as much as the time it held the instance.
    """

    rows: float = 0.0
    tokens: float = 0.0
    seconds: float = 0.0
    """0 until a batch has been measured: then no rate is known."""

    def record(self, rows: int, tokens: int, seconds: float) -> None:
        """A batch of `rows` rows and `tokens` real tokens ran for `seconds`."""
        if seconds <= 0:
            return
        if not self.seconds:
            self.rows, self.tokens, self.seconds = float(rows), float(tokens), seconds
            return
        kept = 1.0 - LATEST_BATCH_WEIGHT
        self.rows = kept * self.rows + LATEST_BATCH_WEIGHT * rows
        self.tokens = kept * self.tokens + LATEST_BATCH_WEIGHT * tokens
        self.seconds = kept * self.seconds + LATEST_BATCH_WEIGHT * seconds

    @property
    def rows_per_s(self) -> float:
        """Rows an instance runs per second of run; 0 before any batch."""
        return self.rows / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Real tokens an instance runs per second of run; 0 before any batch."""
        return self.tokens / self.seconds if self.seconds else 0.0
