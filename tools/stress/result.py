"""What the stress suite found: per phase, the outcome of every request, the probe and the memory."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tools.stress.monitor import Probe, RssSample

UNANSWERED = "UNANSWERED"
"""Outcome of a request that got no response at all within the safety timeout."""
FAILURES = frozenset({"UNKNOWN", "INTERNAL", UNANSWERED})
"""Outcomes that fail the suite in any phase, the probe's included."""
MIB = 1024 * 1024


@dataclass
class Tally:
    """Outcomes of one phase's requests: gRPC status names, `HTTP 413`..., UNANSWERED, raw-socket and stream ones."""

    outcomes: Counter[str] = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)

    def add(self, outcome: str) -> None:
        """Count one request's outcome."""
        self.outcomes[outcome] += 1

    def add_all(self, outcomes: Sequence[str]) -> None:
        """Count several outcomes."""
        self.outcomes.update(outcomes)


@dataclass(frozen=True)
class ProbeStats:
    """The small probe request (or the health check) during one phase."""

    sent: int
    outcomes: dict[str, int]
    p50_ms: float | None
    p99_ms: float | None
    max_ms: float | None

    @classmethod
    def of(cls, probes: Sequence[Probe]) -> ProbeStats:
        """Latency percentiles of the successful probes, and every probe's outcome."""
        latencies = [probe.latency_s * 1e3 for probe in probes if probe.code == "OK"]
        p50 = p99 = peak = None
        if latencies:
            p50, p99, peak = (round(float(value), 2) for value in np.percentile(latencies, [50, 99, 100]))
        outcomes = Counter(probe.code for probe in probes)
        return cls(len(probes), dict(sorted(outcomes.items())), p50, p99, peak)


@dataclass(frozen=True)
class RssStats:
    """The server's resident memory around one phase (the samples in it, the one before and the one after), MiB."""

    start_mib: float
    max_mib: float
    end_mib: float

    @classmethod
    def of(cls, samples: Sequence[RssSample]) -> RssStats | None:
        """First, largest and last sample; None without samples."""
        if not samples:
            return None
        values = [sample.rss_bytes / MIB for sample in samples]
        return cls(round(values[0], 1), round(max(values), 1), round(values[-1], 1))


@dataclass(frozen=True)
class PhaseResult:
    """One phase: what was sent, what came back, and how the server fared meanwhile."""

    name: str
    description: str
    started_s: float
    """Seconds since the suite started."""
    duration_s: float
    outcomes: dict[str, int]
    """Requests (or raw streams and connections) by outcome."""
    allowed: tuple[str, ...]
    """Outcomes this phase may produce; anything else is unexpected."""
    notes: tuple[str, ...]
    probe: ProbeStats
    health: ProbeStats
    """The health check (grpc.health.v1), sent alongside as the probe is."""
    rss: RssStats | None
    """None when the server's process cannot be watched."""
    loop_lag_max_s: float | None
    """The server's largest event-loop lag during the phase and its settling, as the smallest bucket bound of
    encoder_event_loop_lag_seconds it was within (inf: over the largest); None without --metrics-url or samples."""
    refusals: dict[str, int] | None
    """Requests the server refused during the phase and its settling, by reason, the probe's included
    (encoder_requests_rejected_total); None without --metrics-url."""
    leftover: dict[str, float] | None
    """In-flight and queued requests the server still reported after the phase, once settled
    (None without --metrics-url)."""
    settle_s: float
    """How long after the phase the server took to report nothing in flight and to go idle."""
    cpu_share_after: float | None
    """Share of one core the server still used when the next phase began (None: process unknown)."""

    @property
    def sent(self) -> int:
        """Requests (or streams and connections) the phase sent."""
        return sum(self.outcomes.values())

    @property
    def unanswered(self) -> int:
        """Requests accepted but never answered."""
        return self.outcomes.get(UNANSWERED, 0)

    @property
    def unexpected(self) -> dict[str, int]:
        """Outcomes outside the allowed ones (failures included), and probe and health-check failures."""
        found = {code: count for code, count in self.outcomes.items() if code not in self.allowed}
        for kind, stats in (("probe", self.probe), ("health", self.health)):
            for code, count in stats.outcomes.items():
                if code in FAILURES:
                    found[f"{kind} {code}"] = count
        return found

    @property
    def passed(self) -> bool:
        """No unexpected outcome, and nothing left behind in the server."""
        return not self.unexpected and not any(self.leftover.values() if self.leftover else ())

    def to_dict(self) -> dict[str, object]:
        """Plain values for JSON, with the derived counts."""
        values = dataclasses.asdict(self)
        values.update(sent=self.sent, unanswered=self.unanswered, unexpected=self.unexpected, passed=self.passed)
        return values
