"""The stress suite's settings, validated when built."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from client import DEFAULT_MODEL
from protocol.channel_security import ClientSecurity
from tools.stress.rawh2 import split_target

QUICK_SCALE = 0.05
"""`--quick`: every count and hold time scaled down to this share (a run of well under a minute)."""


class StressConfigError(ValueError):
    """Settings that make no sense; raised before anything is sent."""


@dataclass(frozen=True)
class StressConfig:
    """Where to send the load, how much of it, and how long to wait for answers."""

    target: str
    """host:port (raw-socket phases need this form) or any gRPC target."""
    model: str = DEFAULT_MODEL
    security: ClientSecurity = field(default_factory=ClientSecurity)
    scale: float = 1.0
    """Multiplies every phase's request count and hold time (1 = the full run)."""
    safety_timeout_s: float = 60.0
    """How long a request may go without any response before it counts as accepted but never answered."""
    server_pid: int | None = None
    """The server's process, for its RSS; found from the port when the target is on this machine."""
    metrics_url: str | None = None
    """The server's /metrics: after each phase, wait for its in-flight and queue gauges to reach 0, and
    read its event-loop lag and refusals."""
    http_target: str | None = None
    """host:port of the server's HTTP port (KServe v2 REST): without it, the HTTP halves of the
    answer phases are skipped."""
    health_target: str | None = None
    """host:port of the server's plaintext health port (its --health-port, where kubelet's probes go):
    the health check is sent there; without it, to `target` with the load's security."""
    settle_timeout_s: float = 15.0
    """Longest wait after a phase for those gauges to reach 0 and the server's CPU to go idle."""
    stream_seconds: float | None = None
    """How long the stream phase keeps sending (None: 20 s times `scale`, at least 2 s); to see a
    stream outlive its connection, longer than the server's --max-connection-age-s."""
    phases: tuple[str, ...] | None = None
    """Phases to run, in the suite's order (None: all); the final normal request always runs."""
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.target:
            raise StressConfigError("target must not be empty")
        if not self.model:
            raise StressConfigError("model must not be empty")
        for name in ("scale", "safety_timeout_s", "settle_timeout_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise StressConfigError(f"{name} must be positive, got {value:g}")
        if self.server_pid is not None and self.server_pid <= 0:
            raise StressConfigError(f"server_pid must be positive, got {self.server_pid}")
        if self.http_target is not None and split_target(self.http_target) is None:
            raise StressConfigError(f"http_target must be host:port, got {self.http_target!r}")
        if self.health_target is not None and split_target(self.health_target) is None:
            raise StressConfigError(f"health_target must be host:port, got {self.health_target!r}")
        if self.stream_seconds is not None and not (math.isfinite(self.stream_seconds) and self.stream_seconds > 0):
            raise StressConfigError(f"stream_seconds must be positive, got {self.stream_seconds:g}")

    def count(self, full: int, minimum: int = 1) -> int:
        """A phase's count at this scale (`full` at scale 1), at least `minimum`."""
        return max(minimum, round(full * self.scale))

    def seconds(self, full: float, minimum: float = 0.5) -> float:
        """A hold time at this scale, at least `minimum`."""
        return max(minimum, full * self.scale)

    def to_dict(self) -> dict[str, object]:
        """Plain values for JSON (the security settings described, never the key)."""
        return {
            "target": self.target,
            "model": self.model,
            "security": self.security.describe(),
            "scale": self.scale,
            "safety_timeout_s": self.safety_timeout_s,
            "server_pid": self.server_pid,
            "metrics_url": self.metrics_url,
            "http_target": self.http_target,
            "health_target": self.health_target,
            "settle_timeout_s": self.settle_timeout_s,
            "stream_seconds": self.stream_seconds,
            "phases": None if self.phases is None else list(self.phases),
            "seed": self.seed,
        }
