"""The h2load client and the served bench, against a real server (figures are never asserted)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools import h2load
from tools.bench import TINY_MODEL
from tools.served_bench import line, measure


@pytest.mark.usefixtures("h2load_installed")
def test_one_round_measures_the_server_and_the_model_in_process(tiny_repository: Path) -> None:
    result = measure(tiny_repository, TINY_MODEL, "fp32", "auto", threads=1, seconds=0.5)
    # Every figure comes from something that ran: the server's own counters, h2load's log, this process.
    assert result.served_per_s > 0 and result.ceiling_per_s > 0 and result.bound_per_s > 0
    assert 1 <= result.rows_per_run <= 32
    assert result.single_ms > 0 and result.batch_one_ms > 0
    assert line(result).startswith("fp32 on auto: served ")


def test_answers_other_than_ok_stop_a_measurement() -> None:
    answers = h2load.Answers({"OK": 10.0, "CANCELLED": 1.0})
    # A timed run ends with its requests in flight unanswered: the server counts them CANCELLED.
    assert answers.ok_since_last({"OK": 110.0, "CANCELLED": 33.0}, abandoned=32) == 100
    with pytest.raises(RuntimeError, match=r"'CANCELLED': 1\.0"):
        h2load.Answers({}).ok_since_last({"OK": 100.0, "CANCELLED": 33.0}, abandoned=32)
    with pytest.raises(RuntimeError, match=r"'RESOURCE_EXHAUSTED': 3\.0"):
        h2load.Answers({}).ok_since_last({"OK": 100.0, "RESOURCE_EXHAUSTED": 3.0}, abandoned=32)


def test_a_timed_runs_abandoned_requests_may_be_counted_in_a_later_reading_once() -> None:
    # The server counted the timed run's 32 abandoned requests only after the reading that followed it (the
    # second round of `python -m tools.served_bench --rounds 2` once stopped there): the next reading allows them.
    late = h2load.Answers({"OK": 10.0})
    assert late.ok_since_last({"OK": 110.0}, abandoned=32) == 100
    assert late.ok_since_last({"OK": 1110.0, "CANCELLED": 32.0}) == 1000
    # Split between the two readings, they are allowed too, but only as many as were abandoned.
    split = h2load.Answers({})
    assert split.ok_since_last({"OK": 100.0, "CANCELLED": 20.0}, abandoned=32) == 100
    with pytest.raises(RuntimeError, match=r"'CANCELLED': 1\.0"):
        split.ok_since_last({"OK": 200.0, "CANCELLED": 33.0})
    # Once counted, they allow nothing more: a cancelled request of a run with no time limit fails it.
    counted = h2load.Answers({})
    assert counted.ok_since_last({"OK": 100.0, "CANCELLED": 32.0}, abandoned=32) == 100
    with pytest.raises(RuntimeError, match=r"'CANCELLED': 1\.0"):
        counted.ok_since_last({"OK": 200.0, "CANCELLED": 33.0})


@pytest.mark.usefixtures("h2load_installed")
def test_a_failing_h2load_run_says_why(tmp_path: Path) -> None:
    body = tmp_path / "body"
    body.write_bytes(b"")
    arguments = h2load.command("http://127.0.0.1:1/nowhere", body, (), connections=1, requests=-1)
    with pytest.raises(RuntimeError, match=r"h2load failed"):
        h2load.run(arguments)
