"""The load generator: its CLI and library against real servers, and its validation without one."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TINY_MODEL, requests_answered
from tests.servers import ROOT, RunningServer, free_port
from tools.loadtest import (
    ConfigError,
    Level,
    LevelResult,
    LoadConfig,
    Workload,
    check_target,
    format_table,
    parse_levels,
    parse_mix,
    run_level,
    write_reports,
)
from tools.loadtest.__main__ import main

PERCENTILES = ("latency_p50_ms", "latency_p90_ms", "latency_p95_ms", "latency_p99_ms", "latency_max_ms")
QUICK = ("--duration-s", "1.2", "--warmup-s", "0.3", "--no-progress")


def read_results(output_dir: Path) -> tuple[dict, list[dict[str, str]]]:
    """The JSON document and CSV rows of the one run written to output_dir; checks the PNG is there."""
    (json_path,) = output_dir.glob("*.json")
    assert json_path.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with json_path.with_suffix(".csv").open(newline="") as file:
        rows = list(csv.DictReader(file))
    return json.loads(json_path.read_text()), rows


def assert_clean_level(level: dict, batch_size: int) -> None:
    """Requests succeeded, none failed, percentiles ordered, sequences/s = requests/s x batch size."""
    assert level["succeeded"] > 0 and level["failed"] == 0 and level["failures_by_code"] == {}
    assert level["requests_sent"] == level["succeeded"] and level["dropped"] == 0
    assert level["sequences"] == level["succeeded"] * batch_size
    assert level["sequences_per_s"] == pytest.approx(level["throughput_rps"] * batch_size, abs=0.01)
    assert level["throughput_rps"] == pytest.approx(level["succeeded"] / level["duration_s"], abs=0.001)
    values = [level[name] for name in PERCENTILES]
    assert values[0] > 0 and values == sorted(values)


def test_closed_loop_sweep_writes_consistent_json_csv_and_png(tiny_server: RunningServer, tmp_path: Path) -> None:
    before = requests_answered(tiny_server)
    command = [
        *(sys.executable, "-m", "tools.loadtest", "--target", tiny_server.target, "--model", TINY_MODEL),
        *("--concurrency", "1,4", "--batch-size", "2", "--mix", "short=0.7,long=0.3", "--output-dir", str(tmp_path)),
        *QUICK,
    ]
    finished = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert finished.returncode == 0, finished.stderr
    assert "p99 ms" in finished.stdout and "c=4" in finished.stdout
    document, rows = read_results(tmp_path)
    assert document["config"]["batch_size"] == 2 and document["config"]["mix"] == {"short": 0.7, "long": 0.3}
    levels = document["levels"]
    assert [(level["mode"], level["level"]) for level in levels] == [("closed", 1), ("closed", 4)]
    for level in levels:
        assert_clean_level(level, batch_size=2)
    assert [(row["label"], int(row["succeeded"]), float(row["latency_p99_ms"])) for row in rows] == [
        (level["label"], level["succeeded"], level["latency_p99_ms"]) for level in levels
    ]
    # Warm-up requests reached the server too, so it answered more than were measured.
    assert requests_answered(tiny_server) - before >= sum(level["requests_sent"] for level in levels)


def test_open_loop_at_a_low_rate(tiny_server: RunningServer, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    arguments = ["--target", tiny_server.target, "--model", TINY_MODEL, "--rate", "25", "--output-dir", str(tmp_path)]
    assert main([*arguments, *QUICK, "--duration-s", "1.5"]) == 0
    assert "25/s" in capsys.readouterr().out
    document, rows = read_results(tmp_path)
    (level,) = document["levels"]
    assert level["mode"] == "open" and level["level"] == 25 and len(rows) == 1
    assert_clean_level(level, batch_size=1)
    assert level["offered_rps"] == pytest.approx(level["requests_sent"] / 1.5, abs=0.001)


def test_token_input_with_the_default_tokenizer(
    tiny_server: RunningServer, default_folder: Path, tmp_path: Path
) -> None:
    arguments = [
        *("--target", tiny_server.target, "--model", TINY_MODEL, "--concurrency", "2", "--output-dir", str(tmp_path)),
        *("--input", "tokens", "--tokenizer", str(default_folder / "tokenizer.json"), "--max-length", "128"),
        *("--mix", "short=0.5,long=0.5", "--batch-size", "3"),
    ]
    assert main([*arguments, *QUICK]) == 0
    document, _ = read_results(tmp_path)
    assert document["config"]["input_kind"] == "tokens"
    assert_clean_level(document["levels"][0], batch_size=3)


def test_token_workload_truncates_and_pads_to_the_longest(default_folder: Path) -> None:
    config = LoadConfig(
        target="127.0.0.1:1",
        input_kind="tokens",
        tokenizer_path=default_folder / "tokenizer.json",
        max_length=64,
        batch_size=4,
        mix={"short": 1, "long": 1},
        pool_size=20,
    )
    workload = Workload.build(config)
    assert workload.inputs == {"input_ids": "INT64", "attention_mask": "INT64"}
    shapes = {tuple(request.message.inputs[0].shape) for request in workload.requests}
    assert {rows for rows, _ in shapes} == {4} and {length for _, length in shapes} <= set(range(2, 65))
    assert (4, 64) in shapes and any(length < 64 for _, length in shapes)  # long ones truncated, short ones not padded
    assert {request.kind for request in workload.requests} == {"short", "long"}


def test_server_errors_are_counted_by_status_and_the_run_completes(slow_server: RunningServer, tmp_path: Path) -> None:
    arguments = [
        *("--target", slow_server.target, "--model", TINY_MODEL, "--concurrency", "8", "--timeout-s", "5"),
        *("--output-dir", str(tmp_path), "--duration-s", "1", "--warmup-s", "0", "--no-progress"),
    ]
    assert main(arguments) == 0
    document, rows = read_results(tmp_path)
    (level,) = document["levels"]
    assert level["failures_by_code"].get("RESOURCE_EXHAUSTED", 0) > 0
    assert level["failed"] == sum(level["failures_by_code"].values())
    assert level["requests_sent"] == level["succeeded"] + level["failed"]
    assert int(rows[0]["failed_RESOURCE_EXHAUSTED"]) == level["failures_by_code"]["RESOURCE_EXHAUSTED"]


BAD_USES = {
    "zero concurrency": ["--concurrency", "0"],
    "negative concurrency": ["--concurrency", "1,-4"],
    "fractional concurrency": ["--concurrency", "1.5"],
    "both modes": ["--concurrency", "2", "--rate", "5"],
    "empty mix": ["--mix", ""],
    "unknown mix key": ["--mix", "short=0.5,medium=0.5"],
    "zero duration": ["--duration-s", "0"],
    "not a number": ["--duration-s", "soon"],
    "tokens without tokenizer": ["--input", "tokens"],
    "missing tokenizer file": ["--input", "tokens", "--tokenizer", "/nonexistent/tokenizer.json"],
    "unknown model": ["--model", "no-such-model"],
    "unknown option": ["--turbo"],
}


def test_bad_use_exits_2_with_one_line_and_sends_nothing(
    tiny_server: RunningServer, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    before = requests_answered(tiny_server)
    base = ["--target", tiny_server.target, "--model", TINY_MODEL, "--output-dir", str(tmp_path), *QUICK]
    invocations = {name: [*base, *extra] for name, extra in BAD_USES.items()}
    invocations["unreachable target"] = [*base, "--target", f"127.0.0.1:{free_port()}"]
    invocations["malformed target"] = [*base, "--target", "no port here"]
    invocations["no target"] = ["--model", TINY_MODEL]
    for name, argv in invocations.items():
        assert main(argv) == 2, name
        captured = capsys.readouterr()
        assert captured.out == "", name
        assert captured.err.startswith("loadtest: error: ") and captured.err.count("\n") == 1, (name, captured.err)
    assert requests_answered(tiny_server) == before
    assert not list(tmp_path.iterdir())


async def test_library_runs_a_level_in_process(tiny_server: RunningServer) -> None:
    config = LoadConfig(target=tiny_server.target, model=TINY_MODEL, duration_s=0.6, warmup_s=0.1, pool_size=8)
    workload = Workload.build(config)
    metadata = await check_target(config, workload)
    assert metadata.name == TINY_MODEL
    result = await run_level(config, Level("closed", 3), workload)
    assert isinstance(result, LevelResult)
    assert_clean_level(result.to_dict(), batch_size=1)


def test_levels_and_mix_parsing() -> None:
    assert parse_levels("1, 8,32", "closed") == (Level("closed", 1), Level("closed", 8), Level("closed", 32))
    assert [level.label for level in parse_levels("12.5,100", "open")] == ["12.5/s", "100/s"]
    assert parse_mix("short=0.8,long=0.2") == {"short": 0.8, "long": 0.2}
    for text in ("", "1,,2", "a,b", "0", "-1"):
        with pytest.raises(ConfigError):
            parse_levels(text, "open")
    for text in ("", "short", "short=x", "short=0", "short=-1,long=2", "tiny=1"):
        with pytest.raises(ConfigError):
            parse_mix(text)


def test_reports_of_a_level_without_successes(tmp_path: Path) -> None:
    config = LoadConfig(target="127.0.0.1:1")
    result = LevelResult(
        mode="closed",
        level=4,
        label="c=4",
        duration_s=1.0,
        requests_sent=3,
        succeeded=0,
        failed=3,
        failures_by_code={"UNAVAILABLE": 3},
        dropped=0,
        sequences=0,
        offered_rps=3.0,
        throughput_rps=0.0,
        sequences_per_s=0.0,
        latency_p50_ms=None,
        latency_p90_ms=None,
        latency_p95_ms=None,
        latency_p99_ms=None,
        latency_max_ms=None,
    )
    table = format_table([result])
    assert "c=4" in table and "UNAVAILABLE 3" in table
    paths = write_reports(tmp_path / "out", "run", config, [result])
    assert [path.name for path in paths] == ["run.json", "run.csv", "run.png"]
    document, rows = read_results(tmp_path / "out")
    assert document["levels"][0]["latency_p99_ms"] is None and rows[0]["failed_UNAVAILABLE"] == "3"


def test_streaming_closed_loop(tiny_server: RunningServer, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    before = requests_answered(tiny_server)
    arguments = ["--target", tiny_server.target, "--model", TINY_MODEL, "--concurrency", "1,4", "--streaming"]
    assert main([*arguments, "--output-dir", str(tmp_path), *QUICK]) == 0
    assert "c=4" in capsys.readouterr().out
    document, _ = read_results(tmp_path)
    assert document["config"]["streaming"] is True
    for level in document["levels"]:
        assert_clean_level(level, batch_size=1)
    assert requests_answered(tiny_server) - before >= sum(level["requests_sent"] for level in document["levels"])


def test_streaming_is_a_closed_loop_only(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    arguments = ["--target", "127.0.0.1:1", "--rate", "10", "--streaming", "--output-dir", str(tmp_path)]
    assert main(arguments) == 2
    assert "--streaming is a closed loop" in capsys.readouterr().err
