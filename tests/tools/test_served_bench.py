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
    before = {"OK": 10.0, "CANCELLED": 1.0}
    # A timed run ends with its requests in flight unanswered: the server counts them CANCELLED.
    assert h2load.answered_ok(before, {"OK": 110.0, "CANCELLED": 33.0}, in_flight=32) == 100
    with pytest.raises(RuntimeError, match=r"'CANCELLED': 1\.0"):
        h2load.answered_ok(before, {"OK": 110.0, "CANCELLED": 34.0}, in_flight=32)
    with pytest.raises(RuntimeError, match=r"'RESOURCE_EXHAUSTED': 3\.0"):
        h2load.answered_ok(before, {"OK": 110.0, "RESOURCE_EXHAUSTED": 3.0}, in_flight=32)


@pytest.mark.usefixtures("h2load_installed")
def test_a_failing_h2load_run_says_why(tmp_path: Path) -> None:
    body = tmp_path / "body"
    body.write_bytes(b"")
    arguments = h2load.command("http://127.0.0.1:1/nowhere", body, (), connections=1, requests=-1)
    with pytest.raises(RuntimeError, match=r"h2load failed"):
        h2load.run(arguments)
