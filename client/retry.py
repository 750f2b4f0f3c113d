"""When to try a call again: exponential backoff with full jitter, the server's hint honoured."""

from __future__ import annotations

import random
from dataclasses import dataclass

from client.errors import RETRYABLE, EmbeddingError


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of RESOURCE_EXHAUSTED and UNAVAILABLE; any other status is raised at once.

    The n-th retry waits a random time in [0, min(max_backoff_s, initial_backoff_s x multiplier^n)]
    (full jitter, so a fleet of clients refused together does not come back together), or the
    server's retry hint when it sent one (a tenant's limit), whichever is longer.
    """

    max_attempts: int = 8
    """Tries of one call in all (1: never retry)."""
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 5.0
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.initial_backoff_s < 0 or self.max_backoff_s < self.initial_backoff_s:
            raise ValueError("a retry policy needs max_attempts >= 1 and 0 <= initial_backoff_s <= max_backoff_s")
        if self.multiplier < 1:
            raise ValueError("a retry policy's multiplier must be at least 1")

    def delay_s(self, error: EmbeddingError, attempt: int) -> float | None:
        """Seconds to wait before trying again after `attempt` (1-based) failed with `error`; None: give up."""
        if not isinstance(error, RETRYABLE) or attempt >= self.max_attempts:
            return None
        return self.backoff_s(attempt, error.retry_after_s)

    def backoff_s(self, attempt: int, hint_s: float | None = None) -> float:
        """The jittered wait after the `attempt`-th failure, at least the server's hint."""
        ceiling = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (attempt - 1))
        return max(random.uniform(0, ceiling), hint_s or 0.0)


NO_RETRIES = RetryPolicy(max_attempts=1)
"""Every failure raised at once."""
