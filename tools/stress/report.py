"""The stress suite's results out: a table on stdout, JSON, and a PNG of memory and latencies over time."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from tools.stress.result import PhaseResult
from tools.stress.suite import SuiteResult

logger = logging.getLogger(__name__)

_HEADINGS = (
    "phase",
    "seconds",
    "sent",
    "unanswered",
    "unexpected",
    "probe p50 ms",
    "probe p99 ms",
    "health ms p50/p99/max",
    "loop lag <= s",
    "RSS MiB start/max/end",
    "left",
    "settle s",
)


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _row(phase: PhaseResult) -> list[str]:
    rss = "-" if phase.rss is None else f"{phase.rss.start_mib:.0f}/{phase.rss.max_mib:.0f}/{phase.rss.end_mib:.0f}"
    health = "/".join(_number(value) for value in (phase.health.p50_ms, phase.health.p99_ms, phase.health.max_ms))
    left = "-" if phase.leftover is None else "/".join(f"{value:g}" for value in phase.leftover.values())
    return [
        phase.name,
        f"{phase.duration_s:.1f}",
        str(phase.sent),
        str(phase.unanswered),
        str(sum(phase.unexpected.values())),
        _number(phase.probe.p50_ms),
        _number(phase.probe.p99_ms),
        health,
        "-" if phase.loop_lag_max_s is None else f"{phase.loop_lag_max_s:g}",
        rss,
        left,
        f"{phase.settle_s:.1f}",
    ]


def format_table(result: SuiteResult) -> str:
    """One row per phase, then each phase's outcomes, notes and anything unexpected, then the verdict."""
    rows = [list(_HEADINGS), *(_row(phase) for phase in result.phases)]
    widths = [max(len(row[index]) for row in rows) for index in range(len(_HEADINGS))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.append("")
    for phase in result.phases:
        details = [", ".join(f"{code} {count}" for code, count in phase.outcomes.items()) or "no requests"]
        details += list(phase.notes)
        if phase.refusals:
            details.append(
                "server refused: " + ", ".join(f"{reason} {count}" for reason, count in phase.refusals.items())
            )
        for kind, stats in (("probe", phase.probe), ("health", phase.health)):
            if stats.outcomes.keys() - {"OK"}:
                details.append(f"{kind}: " + ", ".join(f"{code} {count}" for code, count in stats.outcomes.items()))
        if phase.unexpected:
            details.append("UNEXPECTED: " + ", ".join(f"{code} {count}" for code, count in phase.unexpected.items()))
        lines.append(f"{phase.name}: " + "; ".join(details))
    lines.append(
        "health: grpc.health.v1 Check latency (on --health-target when given, as kubelet probes);"
        " loop lag <= s: the bucket bound of the server's largest event-loop"
        " lag during the phase and its settling (encoder_event_loop_lag_seconds); left: in-flight/queued requests"
        " the server still reported after the phase; settle s: until it reported none and its CPU went idle"
    )
    lines.append("PASSED" if result.passed else "FAILED")
    return "\n".join(lines)


def plot(path: Path, result: SuiteResult) -> None:
    """Server RSS (top) and probe and health-check latency (bottom) over time, phases shaded and named."""
    figure = Figure(figsize=(11, 7), layout="constrained")
    FigureCanvasAgg(figure)
    memory, latency = figure.subplots(2, 1, sharex=True)
    for index, phase in enumerate(result.phases):
        for axes in (memory, latency):
            axes.axvspan(phase.started_s, phase.started_s + phase.duration_s, alpha=0.12, color=f"C{index % 10}")
        memory.annotate(
            phase.name,
            (phase.started_s, 1.0),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            fontsize=7,
        )
    if result.rss:
        memory.plot([s.at for s in result.rss], [s.rss_bytes / 2**20 for s in result.rss], color="black", lw=1)
    else:
        memory.text(0.5, 0.5, "server RSS not available", transform=memory.transAxes, ha="center")
    memory.set_ylabel("server RSS (MiB)")
    memory.set_ylim(bottom=0)
    ok = [(p.sent_at, p.latency_s * 1e3) for p in result.probes if p.code == "OK"]
    failed = [(p.sent_at, p.latency_s * 1e3) for p in result.probes if p.code != "OK"]
    health = [(c.sent_at, c.latency_s * 1e3) for c in result.health if c.code == "OK"]
    if ok:
        latency.scatter(*zip(*ok, strict=True), s=4, color="C0", label="probe OK")
    if health:
        latency.scatter(*zip(*health, strict=True), s=4, color="C2", label="health check")
    if failed:
        latency.scatter(*zip(*failed, strict=True), s=12, marker="x", color="C3", label="probe failed")
    latency.set_yscale("log")
    latency.set_ylabel("latency (ms)")
    latency.set_xlabel("time since the suite started (s)")
    if ok or health or failed:
        latency.legend(loc="upper right")
    figure.suptitle(
        f"stress: {result.config.model} at {result.config.target} ({'PASSED' if result.passed else 'FAILED'})"
    )
    figure.savefig(path, dpi=110)


def write_reports(output_dir: Path, stem: str, result: SuiteResult) -> list[Path]:
    """`<stem>.json` and `<stem>.png` in output_dir (created if needed); returns their paths."""
    output_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = output_dir / f"{stem}.json", output_dir / f"{stem}.png"
    json_path.write_text(json.dumps(result.to_dict(), indent=2) + "\n", encoding="utf-8")
    plot(png_path, result)
    logger.info("wrote %s and %s", json_path, png_path)
    return [json_path, png_path]
