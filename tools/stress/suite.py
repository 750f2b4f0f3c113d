"""Run the stress suite: check the target, start the monitor, run each phase, settle, collect results."""

from __future__ import annotations

import asyncio
import logging
import random
import time
import urllib.request
from dataclasses import dataclass

import grpc
from prometheus_client.parser import text_string_to_metric_families

from protocol import grpc_service_pb2 as pb
from protocol import grpc_service_pb2_grpc as pb_grpc
from tools.stress import rawh1, rawh2
from tools.stress.config import StressConfig
from tools.stress.monitor import (
    Monitor,
    MonitorSettings,
    Probe,
    RssSample,
    find_listening_pid,
    is_local_host,
    read_cpu_seconds,
)
from tools.stress.phases import FINAL, PHASES, Phase, StressContext
from tools.stress.result import PhaseResult, ProbeStats, RssStats, Tally

logger = logging.getLogger(__name__)

LEFTOVER_GAUGES = ("encoder_inflight_requests", "encoder_queue_depth")
"""Gauges that must return to 0 once a phase's requests are all answered or dropped."""
LOOP_LAG_BUCKET = "encoder_event_loop_lag_seconds_bucket"
REFUSALS = "encoder_requests_rejected_total"
SETTLE_POLL_S = 0.1
CPU_WINDOW_S = 0.25
QUIET_CPU_SHARE = 0.1
"""The server counts as idle below this share of one core (model runs of dropped requests show above it)."""


class TargetError(RuntimeError):
    """The target cannot be stressed: unreachable, not ready, or refusing our credentials."""


@dataclass(frozen=True)
class SuiteResult:
    """Every phase's result, with the probe, health and RSS series they were cut from (times from the suite's start)."""

    config: StressConfig
    server_pid: int | None
    queue_bound: int | None
    phases: tuple[PhaseResult, ...]
    probes: tuple[Probe, ...]
    health: tuple[Probe, ...]
    rss: tuple[RssSample, ...]

    @property
    def passed(self) -> bool:
        """Every phase passed (the final normal request included)."""
        return all(phase.passed for phase in self.phases)

    def to_dict(self) -> dict[str, object]:
        """Plain values for JSON."""
        return {
            "config": self.config.to_dict(),
            "server_pid": self.server_pid,
            "queue_bound": self.queue_bound,
            "passed": self.passed,
            "phases": [phase.to_dict() for phase in self.phases],
            "probes": [[round(p.sent_at, 4), round(p.latency_s * 1e3, 3), p.code] for p in self.probes],
            "health": [[round(p.sent_at, 4), round(p.latency_s * 1e3, 3), p.code] for p in self.health],
            "rss_mib": [[round(s.at, 3), round(s.rss_bytes / 2**20, 2)] for s in self.rss],
        }


async def check_target(config: StressConfig) -> int | None:
    """Fail with TargetError unless server and model are ready; returns the model's queue bound if reported."""
    context = StressContext(config, random.Random(config.seed), None)
    call = {"timeout": 10.0, "metadata": context.metadata}
    async with context.channel() as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        try:
            if not (await stub.ServerReady(pb.ServerReadyRequest(), **call)).ready:
                raise TargetError(f"server at {config.target} is not ready")
            if not (await stub.ModelReady(pb.ModelReadyRequest(name=config.model), **call)).ready:
                raise TargetError(f"model {config.model!r} is not ready at {config.target}")
            response = await stub.ModelConfig(pb.ModelConfigRequest(name=config.model), **call)
        except grpc.aio.AioRpcError as error:
            details = " ".join((error.details() or "").split())
            raise TargetError(f"cannot use {config.target}: {error.code().name}: {details}") from None
    if config.http_target is not None:
        await _check_http(config, config.http_target)
    bound = response.config.dynamic_batching.default_queue_policy.max_queue_size
    return bound or None


async def _check_http(config: StressConfig, http_target: str) -> None:
    """Fail with TargetError unless the HTTP port answers its readiness route with 200."""
    address = rawh2.split_target(http_target)
    assert address is not None  # checked by StressConfig
    request = rawh1.request_bytes("GET", "/v2/health/ready", http_target, b"")
    try:
        answer = await rawh1.status(*address, config.security, request, safety_timeout_s=10.0)
    except (OSError, asyncio.TimeoutError) as error:
        raise TargetError(f"cannot use the HTTP port {http_target}: {str(error) or type(error).__name__}") from None
    if answer != "HTTP 200":
        raise TargetError(f"the HTTP port {http_target} answered GET /v2/health/ready with {answer}")


def server_pid(config: StressConfig) -> int | None:
    """The server's process: as given, or the local process listening on the target's port."""
    if config.server_pid is not None:
        return config.server_pid
    address = rawh2.split_target(config.target)
    if address is None or not is_local_host(address[0]):
        return None
    return find_listening_pid(address[1])


def _gauges(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    totals = dict.fromkeys(LEFTOVER_GAUGES, 0.0)
    for family in text_string_to_metric_families(text):
        if family.name in totals:
            totals[family.name] = sum(sample.value for sample in family.samples)
    return totals


@dataclass(frozen=True)
class ServerCounters:
    """Cumulative figures from the server's /metrics: event-loop lag buckets and refusals by reason."""

    lag_buckets: dict[float, float]
    """Observations at or under each bucket bound (+Inf included), every process summed."""
    refusals: dict[str, float]

    @classmethod
    def read(cls, url: str) -> ServerCounters:
        """Scrape them now."""
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        lag_buckets: dict[float, float] = {}
        refusals: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == LOOP_LAG_BUCKET:
                    bound = float(sample.labels["le"])
                    lag_buckets[bound] = lag_buckets.get(bound, 0.0) + sample.value
                elif sample.name == REFUSALS:
                    reason = sample.labels.get("reason", "")
                    refusals[reason] = refusals.get(reason, 0.0) + sample.value
        return cls(lag_buckets, refusals)

    def lag_bound_since(self, before: ServerCounters) -> float | None:
        """The smallest bucket bound that holds every lag observed since `before`; None when none was."""
        deltas = sorted(
            (bound, count - before.lag_buckets.get(bound, 0.0)) for bound, count in self.lag_buckets.items()
        )
        total = deltas[-1][1] if deltas else 0.0
        if total <= 0:
            return None
        return next(bound for bound, count in deltas if count >= total)

    def refusals_since(self, before: ServerCounters) -> dict[str, int]:
        """Refusals since `before`, by reason (the reasons with any)."""
        deltas = {reason: round(count - before.refusals.get(reason, 0.0)) for reason, count in self.refusals.items()}
        return {reason: count for reason, count in sorted(deltas.items()) if count}


async def _counters(config: StressConfig) -> ServerCounters | None:
    return None if config.metrics_url is None else await asyncio.to_thread(ServerCounters.read, config.metrics_url)


async def _cpu_share(pid: int) -> float | None:
    """The share of one core the server used over the next CPU_WINDOW_S."""
    before = read_cpu_seconds(pid)
    await asyncio.sleep(CPU_WINDOW_S)
    after = read_cpu_seconds(pid)
    return None if before is None or after is None else round((after - before) / CPU_WINDOW_S, 3)


async def settle(config: StressConfig, pid: int | None) -> tuple[dict[str, float] | None, float | None]:
    """Wait until the server reports nothing in flight or queued and its CPU is idle, or the settle timeout.

    Returns the gauges it last reported (None without a metrics URL) and the share of a core it
    last used (None when its process is unknown).
    """
    deadline = time.monotonic() + config.settle_timeout_s
    while True:
        gauges = None if config.metrics_url is None else await asyncio.to_thread(_gauges, config.metrics_url)
        cpu_share = None if pid is None else await _cpu_share(pid)
        quiet = not any((gauges or {}).values()) and (cpu_share is None or cpu_share < QUIET_CPU_SHARE)
        if quiet or time.monotonic() >= deadline:
            return gauges, cpu_share
        if cpu_share is None:
            await asyncio.sleep(SETTLE_POLL_S)


@dataclass(frozen=True)
class _Window:
    phase: Phase
    started: float
    ended: float
    tally: Tally
    leftover: dict[str, float] | None
    settled: float
    cpu_share_after: float | None
    loop_lag_max_s: float | None
    refusals: dict[str, int] | None


async def _run_phases(
    context: StressContext, phases: tuple[Phase, ...], monitor: Monitor, pid: int | None
) -> list[_Window]:
    windows = []
    counters = await _counters(context.config)
    for phase in phases:
        logger.info("phase %s: %s", phase.name, phase.description)
        tally = Tally()
        started = time.monotonic()
        await phase.run(context, tally)
        ended = time.monotonic()
        # Before the next phase, the server must be done with this one's work (a model still running
        # dropped requests would slow the next phase's probe); the probe itself is paused meanwhile,
        # or it would count as in flight.
        await asyncio.to_thread(monitor.pause)
        leftover, cpu_share = await settle(context.config, pid)
        settled = time.monotonic()
        before, counters = counters, await _counters(context.config)
        monitor.resume()
        if cpu_share is not None and cpu_share >= QUIET_CPU_SHARE:
            tally.notes.append(
                f"server still busy ({cpu_share:.0%} of a core) {context.config.settle_timeout_s:g} s on"
            )
        lag = refusals = None
        if before is not None and counters is not None:
            lag, refusals = counters.lag_bound_since(before), counters.refusals_since(before)
        windows.append(_Window(phase, started, ended, tally, leftover, settled, cpu_share, lag, refusals))
        logger.info("phase %s done in %.1f s: %s", phase.name, ended - started, dict(tally.outcomes))
    return windows


def samples_around(samples: list[RssSample], started: float, ended: float) -> list[RssSample]:
    """The memory samples of a window: those taken in it, with the last before it and the first after it.

    So a phase shorter than the sampling interval still has its figures.
    """
    before = [sample for sample in samples if sample.at < started][-1:]
    after = [sample for sample in samples if sample.at > ended][:1]
    return [*before, *(sample for sample in samples if started <= sample.at <= ended), *after]


def _selected(config: StressConfig) -> tuple[Phase, ...]:
    if config.phases is None:
        return (*PHASES, FINAL)
    return (*(phase for phase in PHASES if phase.name in config.phases), FINAL)


async def run_suite(config: StressConfig) -> SuiteResult:
    """Run the selected phases, then the final request, with the probe and RSS sampler alongside."""
    queue_bound = await check_target(config)
    pid = server_pid(config)
    if pid is None:
        logger.warning("server process unknown (give --server-pid): no RSS figures")
    context = StressContext(config, random.Random(config.seed), queue_bound)
    monitor = Monitor(MonitorSettings(config.target, config.model, config.security, pid, config.health_target))
    monitor.start()
    try:
        windows = await _run_phases(context, _selected(config), monitor, pid)
    except BaseException:
        monitor.kill()
        raise
    probes, checks, samples = monitor.stop()
    origin = windows[0].started
    results = []
    for window in windows:
        inside_probes = [p for p in probes if window.started <= p.sent_at < window.ended]
        inside_checks = [c for c in checks if window.started <= c.sent_at < window.ended]
        results.append(
            PhaseResult(
                name=window.phase.name,
                description=window.phase.description,
                started_s=round(window.started - origin, 3),
                duration_s=round(window.ended - window.started, 3),
                outcomes=dict(sorted(window.tally.outcomes.items())),
                allowed=tuple(sorted(window.phase.allowed)),
                notes=tuple(window.tally.notes),
                probe=ProbeStats.of(inside_probes),
                health=ProbeStats.of(inside_checks),
                rss=RssStats.of(samples_around(samples, window.started, window.ended)),
                loop_lag_max_s=window.loop_lag_max_s,
                refusals=window.refusals,
                leftover=window.leftover,
                settle_s=round(window.settled - window.ended, 3),
                cpu_share_after=window.cpu_share_after,
            )
        )
    return SuiteResult(
        config=config,
        server_pid=pid,
        queue_bound=queue_bound,
        phases=tuple(results),
        probes=tuple(Probe(p.sent_at - origin, p.latency_s, p.code) for p in probes),
        health=tuple(Probe(c.sent_at - origin, c.latency_s, c.code) for c in checks),
        rss=tuple(RssSample(s.at - origin, s.rss_bytes) for s in samples),
    )
