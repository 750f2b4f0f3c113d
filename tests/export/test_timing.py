"""Side-by-side timing: a comparison whose order is settled stops early, and only when asked to.

The clock is the test's own (each callable's seconds per call are fixed), so what is checked is the
comparison's logic, never this machine's speed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest

from export.graph import timing
from export.graph.timing import compare_seconds

SECONDS_PER_CALL = {"slow": 0.05, "fast": 0.00001}
"""What the fake clock says each callable takes."""


def _compare(monkeypatch: pytest.MonkeyPatch, until_settled: bool) -> tuple[Counter, dict[str, float]]:
    calls: Counter = Counter()
    runs: dict[str, Callable[[], object]] = {name: (lambda n=name: calls.update([n])) for name in SECONDS_PER_CALL}
    seconds_of = {id(run): SECONDS_PER_CALL[name] for name, run in runs.items()}

    def measured(run: Callable[[], object], min_seconds: float) -> float:
        run()
        return seconds_of[id(run)]

    monkeypatch.setattr(timing, "_seconds_per_call", measured)
    # one call per callable per round, after one warm-up call each.
    return calls, compare_seconds(runs, rounds=5, min_seconds=0.0, until_settled=until_settled)


def test_a_settled_order_stops_after_two_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    calls, seconds = _compare(monkeypatch, until_settled=True)
    assert seconds["fast"] < seconds["slow"]
    assert calls == Counter(slow=3, fast=3)


def test_every_round_runs_unless_asked_to_stop_when_settled(monkeypatch: pytest.MonkeyPatch) -> None:
    calls, seconds = _compare(monkeypatch, until_settled=False)
    assert seconds["fast"] < seconds["slow"]
    assert calls == Counter(slow=6, fast=6)
