"""What one load level measured."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class LevelResult:
    """Counts, throughput and latency of the requests sent in one level's measured window.

    Latency percentiles cover successful requests only (None when there were none).
    """

    mode: str
    """closed or open."""
    level: float
    """Workers (closed) or target requests/s (open)."""
    label: str
    duration_s: float
    """The measured window."""
    requests_sent: int
    succeeded: int
    failed: int
    failures_by_code: dict[str, int]
    """Failed requests by gRPC status code name."""
    dropped: int
    """Open loop: scheduled sends skipped because max_outstanding requests were in flight."""
    sequences: int
    """Sequences in the successful requests."""
    offered_rps: float
    """Requests sent or dropped per second."""
    throughput_rps: float
    """Successful requests per second."""
    sequences_per_s: float
    latency_p50_ms: float | None
    latency_p90_ms: float | None
    latency_p95_ms: float | None
    latency_p99_ms: float | None
    latency_max_ms: float | None

    def to_dict(self) -> dict[str, object]:
        """Plain values for JSON."""
        return dataclasses.asdict(self)
