"""Side-by-side timing: a comparison whose order is settled stops early, and only when asked to."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from export.graph.timing import compare_seconds

SLOW_TERMS = 3_000_000
"""Work for the slow callable: tens of milliseconds, thousands of times the fast one's."""


def _counted(calls: Counter, name: str, work: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        calls[name] += 1
        return work()

    return run


def _compare(until_settled: bool) -> tuple[Counter, dict[str, float]]:
    calls: Counter = Counter()
    runs = {
        "slow": _counted(calls, "slow", lambda: sum(range(SLOW_TERMS))),
        "fast": _counted(calls, "fast", lambda: None),
    }
    # min_seconds 0: one call per callable per round, after one warm-up call each.
    return calls, compare_seconds(runs, rounds=5, min_seconds=0.0, until_settled=until_settled)


def test_a_settled_order_stops_after_two_rounds() -> None:
    calls, seconds = _compare(until_settled=True)
    assert seconds["fast"] < seconds["slow"]
    assert calls == Counter(slow=3, fast=3)


def test_every_round_runs_unless_asked_to_stop_when_settled() -> None:
    calls, seconds = _compare(until_settled=False)
    assert seconds["fast"] < seconds["slow"]
    assert calls == Counter(slow=6, fast=6)
