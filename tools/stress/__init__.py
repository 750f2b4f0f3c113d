"""Stress suite for a running encoder server: hostile load, precise statuses, and a server still serving.

Overload, huge inputs, deadline storms, cancellation, slow readers, oversized answers, slow readers of big
answers, a stream across connection recycles and malformed messages.

    config = StressConfig(target="127.0.0.1:8001", scale=0.05)
    result = asyncio.run(run_suite(config))      # SuiteResult: per-phase outcomes, probe, health, RSS, loop lag
    print(format_table(result)); write_reports(Path("out"), "stress", result)

`python -m tools.stress --help` runs it from the command line.
"""

from __future__ import annotations

from tools.stress.config import QUICK_SCALE, StressConfig, StressConfigError
from tools.stress.phases import PHASE_NAMES
from tools.stress.report import format_table, write_reports
from tools.stress.result import FAILURES, UNANSWERED, PhaseResult
from tools.stress.suite import SuiteResult, TargetError, run_suite

__all__ = [
    "FAILURES",
    "PHASE_NAMES",
    "QUICK_SCALE",
    "UNANSWERED",
    "PhaseResult",
    "StressConfig",
    "StressConfigError",
    "SuiteResult",
    "TargetError",
    "format_table",
    "run_suite",
    "write_reports",
]
