"""Results out: a text table, JSON and CSV (one row per level), and a latency-vs-throughput plot."""

from __future__ import annotations

import csv
import json
import logging
from collections.abc import Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from tools.loadtest.config import LoadConfig
from tools.loadtest.result import LevelResult

logger = logging.getLogger(__name__)

_COLUMNS = (
    ("level", "label", "{}"),
    ("sent", "requests_sent", "{:d}"),
    ("ok", "succeeded", "{:d}"),
    ("failed", "failed", "{:d}"),
    ("dropped", "dropped", "{:d}"),
    ("req/s", "throughput_rps", "{:.1f}"),
    ("seq/s", "sequences_per_s", "{:.1f}"),
    ("p50 ms", "latency_p50_ms", "{:.1f}"),
    ("p90 ms", "latency_p90_ms", "{:.1f}"),
    ("p95 ms", "latency_p95_ms", "{:.1f}"),
    ("p99 ms", "latency_p99_ms", "{:.1f}"),
    ("max ms", "latency_max_ms", "{:.1f}"),
)
_PLOTTED = (("p50", "latency_p50_ms"), ("p95", "latency_p95_ms"), ("p99", "latency_p99_ms"))


def format_table(results: Sequence[LevelResult]) -> str:
    """A fixed-width table, one row per level, then failures by status code if any."""
    rows = [[heading for heading, _, _ in _COLUMNS]]
    for result in results:
        cells = ((getattr(result, name), style) for _, name, style in _COLUMNS)
        rows.append(["-" if value is None else style.format(value) for value, style in cells])
    widths = [max(len(row[index]) for row in rows) for index in range(len(_COLUMNS))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)) for row in rows]
    for result in results:
        if result.failures_by_code:
            codes = ", ".join(f"{code} {count}" for code, count in result.failures_by_code.items())
            lines.append(f"{result.label} failures: {codes}")
    return "\n".join(lines)


def write_json(path: Path, config: LoadConfig, results: Sequence[LevelResult]) -> None:
    """The configuration and every level's result."""
    document = {"config": config.to_dict(), "levels": [result.to_dict() for result in results]}
    path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")


def write_csv(path: Path, results: Sequence[LevelResult]) -> None:
    """One row per level; failures as one `failed_<CODE>` column per status code seen in any level."""
    codes = sorted({code for result in results for code in result.failures_by_code})
    rows = []
    for result in results:
        row = result.to_dict()
        failures = row.pop("failures_by_code")
        row.update({f"failed_{code}": failures.get(code, 0) for code in codes})
        rows.append(row)
    fieldnames = list(rows[0]) if rows else []
    with path.open("w", newline="", encoding="utf-8") as file:
        writer = csv.DictWriter(file, fieldnames=fieldnames)
        writer.writeheader()
        writer.writerows(rows)


def plot_latency(path: Path, config: LoadConfig, results: Sequence[LevelResult]) -> None:
    """p50/p95/p99 latency against achieved throughput, one point per level with a successful request."""
    measured = sorted((r for r in results if r.latency_p50_ms is not None), key=lambda r: r.throughput_rps)
    figure = Figure(figsize=(8, 5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    throughput = [result.throughput_rps for result in measured]
    for name, field in _PLOTTED:
        axes.plot(throughput, [getattr(result, field) for result in measured], marker="o", label=name)
    for result in measured:
        axes.annotate(
            result.label,
            (result.throughput_rps, result.latency_p99_ms),
            textcoords="offset points",
            xytext=(4, 4),
            fontsize=8,
        )
    axes.set_xlabel("achieved throughput (requests/s)")
    axes.set_ylabel("latency (ms)")
    axes.set_ylim(bottom=0)
    axes.set_title(f"{config.model} at {config.target}: {config.input_kind} input, batch {config.batch_size}")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.savefig(path, dpi=120)


def write_reports(output_dir: Path, stem: str, config: LoadConfig, results: Sequence[LevelResult]) -> list[Path]:
    """`<stem>.json`, `<stem>.csv` and `<stem>.png` in output_dir (created if needed); returns their paths."""
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = [output_dir / f"{stem}.{suffix}" for suffix in ("json", "csv", "png")]
    write_json(paths[0], config, results)
    write_csv(paths[1], results)
    plot_latency(paths[2], config, results)
    logger.info("wrote %s", ", ".join(map(str, paths)))
    return paths
