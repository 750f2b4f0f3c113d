"""A short run of the stress suite (`python -m tools.stress --quick`) against a real server.

The server has a queue of 16 requests and waits up to 200 ms for a fuller batch, so the tiny model
cannot drain a burst as fast as it arrives: the bursts go far past the queue. What the issue
demands of the server is asserted here: every request answered, never UNKNOWN or INTERNAL, bursts
refused with RESOURCE_EXHAUSTED rather than CANCELLED (after the deadline storm and the
cancellations too), nothing left in flight, and a normal request served at the end; and of the
suite: its JSON, PNG and table, with the server's RSS watched. The suite's tallies are checked
against the server's own counts, and its verdict against a server whose model fails every run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from onnx import helper

from client import EmbeddingClient
from service.core.repository import FIDELITY_FILE
from tests.conftest import TINY_MODEL
from tests.onnx_graphs import WIDTH, constant, save_token_graph
from tests.servers import ROOT, MetricSamples, RunningServer, free_port, metric_samples, server_pids, start_server
from tools.stress import PHASE_NAMES
from tools.stress.__main__ import main
from tools.stress.monitor import RssSample
from tools.stress.result import RssStats
from tools.stress.suite import samples_around

QUEUE_BOUND = 16
BATCH_DELAY_US = 200_000
RUN_TIMEOUT_S = 420


@dataclass(frozen=True)
class StressRun:
    finished: subprocess.CompletedProcess
    document: dict
    output_dir: Path

    def phase(self, name: str) -> dict:
        (found,) = (phase for phase in self.document["phases"] if phase["name"] == name)
        return found


@pytest.fixture(scope="module")
def stress_server(tiny_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    log_path = tmp_path_factory.mktemp("stress-server") / "server.log"
    arguments = ("--max-queue-size", str(QUEUE_BOUND), "--max-queue-delay-us", str(BATCH_DELAY_US))
    server = start_server(tiny_repository, log_path, *arguments)
    try:
        yield server
    finally:
        server.stop()


def run_stress(server: RunningServer, output_dir: Path, *arguments: str) -> StressRun:
    """`python -m tools.stress --quick` against a server, and the one JSON report it wrote."""
    command = [
        *(sys.executable, "-m", "tools.stress", "--target", server.target, "--model", TINY_MODEL),
        *("--quick", "--metrics-url", server.metrics_url, "--safety-timeout-s", "60"),
        *("--output", str(output_dir), *arguments),
    ]
    finished = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
    json_paths = list(output_dir.glob("stress-*.json"))
    assert len(json_paths) == 1, f"exit {finished.returncode}: {finished.stderr[-2000:]}"
    return StressRun(finished, json.loads(json_paths[0].read_text()), output_dir)


@pytest.fixture(scope="module")
def stress_run(stress_server: RunningServer, tmp_path_factory: pytest.TempPathFactory) -> StressRun:
    return run_stress(stress_server, tmp_path_factory.mktemp("stress-results"))


def answered_by_code(samples: MetricSamples) -> Counter[str]:
    """encoder_requests_total by status code, as the server counts the inference requests it answered."""
    counts: Counter[str] = Counter()
    for (name, labels), value in samples.items():
        if name == "encoder_requests_total":
            counts[dict(labels)["code"]] += int(value)
    return counts


def tallied_by_code(run: StressRun) -> Counter[str]:
    """Every inference request the suite reports, by outcome: each phase's (gRPC inferences here) and each probe's."""
    counts: Counter[str] = Counter()
    for phase in run.document["phases"]:
        counts.update(phase["outcomes"])
    counts.update(code for _, _, code in run.document["probes"])
    return counts


def test_every_phase_ran_and_every_request_was_answered(stress_run: StressRun) -> None:
    phases = stress_run.document["phases"]
    assert [phase["name"] for phase in phases] == [*PHASE_NAMES, "final_request"]
    for phase in phases:
        assert phase["unanswered"] == 0, phase
        if phase["name"] != "baseline":
            assert phase["sent"] > 0, phase


def test_no_request_or_probe_got_unknown_or_internal(stress_run: StressRun) -> None:
    for phase in stress_run.document["phases"]:
        for outcomes in (phase["outcomes"], phase["probe"]["outcomes"]):
            assert not {"UNKNOWN", "INTERNAL"} & outcomes.keys(), (phase["name"], outcomes)


@pytest.mark.parametrize("name", ["burst_one_channel", "burst_many_channels", "burst_after"])
def test_bursts_past_the_queue_bound_are_refused_with_resource_exhausted(stress_run: StressRun, name: str) -> None:
    phase = stress_run.phase(name)
    assert phase["sent"] >= 3 * QUEUE_BOUND
    assert phase["outcomes"].get("OK", 0) > 0 and phase["outcomes"].get("RESOURCE_EXHAUSTED", 0) > 0, phase
    assert phase["outcomes"].keys() <= {"OK", "RESOURCE_EXHAUSTED"}, phase["outcomes"]


def test_slow_readers_got_their_responses_held(stress_run: StressRun) -> None:
    outcomes = stress_run.phase("slow_readers")["outcomes"]
    assert outcomes.get("HELD", 0) > 0, outcomes


def test_every_phase_passed_and_left_nothing_in_flight(stress_run: StressRun) -> None:
    for phase in stress_run.document["phases"]:
        assert phase["leftover"] == {"encoder_inflight_requests": 0, "encoder_queue_depth": 0}, phase["name"]
        assert phase["unexpected"] == {}, (phase["name"], phase["unexpected"], phase["notes"])
    assert stress_run.document["passed"] is True
    assert stress_run.finished.returncode == 0, stress_run.finished.stdout[-3000:]


def test_a_bursts_tallies_are_what_the_server_counted(stress_server: RunningServer, tmp_path: Path) -> None:
    before = answered_by_code(metric_samples(stress_server))
    run = run_stress(stress_server, tmp_path, "--phases", "burst_one_channel")
    after = metric_samples(stress_server)
    answered = answered_by_code(after) - before
    # Code by code, the requests the suite tallied (the burst, the final request, every probe) are
    # the ones the server says it answered: none lost, none counted twice, none given another status.
    assert answered == tallied_by_code(run)
    assert answered["RESOURCE_EXHAUSTED"] > 0 and answered["OK"] > 0, answered
    assert run.phase("burst_one_channel")["outcomes"]["RESOURCE_EXHAUSTED"] <= answered["RESOURCE_EXHAUSTED"]
    # Nothing left in flight or queued, as read by this test from the server itself.
    labels = (("model", TINY_MODEL), ("version", "1"))
    assert after[("encoder_inflight_requests", labels)] == after[("encoder_queue_depth", labels)] == 0
    assert run.document["passed"] is True and run.finished.returncode == 0


def _model_that_always_fails(path: Path) -> None:
    """A graph that loads and fails every run: the ids are reshaped into rows of 1000 tokens (128 at most)."""
    nodes = [
        constant("thousands", [0, -1, 1000]),
        helper.make_node("Reshape", ["ids", "thousands"], ["grouped"]),
        constant("row_axes", [1, 2]),
        helper.make_node("ReduceSum", ["grouped", "row_axes"], ["row_sums"], keepdims=0),
        constant("column", [-1, 1]),
        helper.make_node("Reshape", ["row_sums", "column"], ["row_sums_2d"]),
        constant("widths", [1, WIDTH]),
        helper.make_node("Tile", ["row_sums_2d", "widths"], ["embedding"]),
    ]
    save_token_graph(path, "always_fails", nodes)


def test_a_server_whose_model_fails_gets_a_failing_verdict(repository_copy: Path, tmp_path: Path) -> None:
    _model_that_always_fails(repository_copy / TINY_MODEL / "1" / "model.onnx")
    (repository_copy / TINY_MODEL / FIDELITY_FILE).unlink(missing_ok=True)  # references of the real model
    flags = ("--no-warmup", "--device", "cpu")
    with start_server(repository_copy, tmp_path / "server.log", *flags) as server:
        run = run_stress(server, tmp_path / "results", "--phases", "baseline")
        answered = answered_by_code(metric_samples(server))
    # The server failed every inference, and the suite saw each failure as the server reported it.
    assert set(answered) == {"INTERNAL"}, answered
    assert answered == tallied_by_code(run)
    assert run.phase("final_request")["outcomes"] == {"INTERNAL": 1}
    # Its own request, and the probe sent alongside when one fell within the phase.
    assert run.phase("final_request")["unexpected"]["INTERNAL"] == 1
    assert set(run.phase("final_request")["unexpected"]) <= {"INTERNAL", "probe INTERNAL"}
    assert run.phase("final_request")["passed"] is False
    assert run.document["passed"] is False
    assert run.finished.returncode == 1, run.finished.stderr[-2000:]


def test_the_final_request_succeeded_and_the_server_still_serves(
    stress_run: StressRun, stress_server: RunningServer
) -> None:
    assert stress_run.phase("final_request")["outcomes"] == {"OK": 1}
    with EmbeddingClient(stress_server.target, model=TINY_MODEL, timeout_s=10) as client:
        assert client.embed(["after the storm"]).shape == (1, 32)


def test_reports_table_json_png_and_server_memory(stress_run: StressRun, stress_server: RunningServer) -> None:
    (png_path,) = stress_run.output_dir.glob("stress-*.png")
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    stdout = stress_run.finished.stdout
    assert all(name in stdout for name in PHASE_NAMES) and "probe p99 ms" in stdout
    document = stress_run.document
    # The server's process was found from its port (the one holding it: under a supervisor, a child), and its
    # memory sampled through the run.
    assert document["server_pid"] in server_pids(stress_server)
    assert len(document["rss_mib"]) > 10 and all(mib > 0 for _, mib in document["rss_mib"])
    assert stress_run.phase("huge_texts")["rss"]["max_mib"] > 0
    assert document["queue_bound"] == QUEUE_BOUND
    # The probe ran alongside (phases shorter than one probe may have none of their own).
    assert stress_run.phase("baseline")["probe"]["p50_ms"] > 0
    assert sum(phase["probe"]["sent"] for phase in document["phases"]) > 10


def test_bad_arguments_and_an_unreachable_target_exit_2(capsys: pytest.CaptureFixture) -> None:
    assert main(["--target", "127.0.0.1:1", "--phases", "burst,nonsense"]) == 2
    assert "unknown phase" in capsys.readouterr().err
    assert main(["--target", "127.0.0.1:1", "--tls-cert", "client.pem"]) == 2
    assert "--tls-key" in capsys.readouterr().err
    assert main(["--target", f"127.0.0.1:{free_port()}", "--quick"]) == 2
    assert capsys.readouterr().err.startswith("stress: error: cannot use")


def test_a_phase_shorter_than_the_sampling_interval_has_the_memory_around_it() -> None:
    samples = [RssSample(at, rss_bytes=mib * 2**20) for at, mib in ((0.0, 100), (0.1, 130), (0.2, 120), (0.3, 110))]
    assert samples_around(samples, 0.13, 0.16) == samples[1:3]  # no sample inside: the one before, the one after
    assert samples_around(samples, 0.05, 0.25) == samples
    assert RssStats.of(samples_around(samples, 0.13, 0.16)) == RssStats(130.0, 130.0, 120.0)
