"""The stress suite's answer and stream phases, each at small scale against a real server on loopback.

The server's limits are shrunk to the tiny model's answers (hidden size 32, 128 tokens): a request
of 64 texts asks for a 1 MiB last_hidden_state (4 MiB of JSON), over a 768 KiB response limit;
one of 32 texts (raw) or 8 texts (JSON) for 512 KiB, of which an answer budget of 1.5 MiB holds
three. Connections live 2 s, so a stream that sends for 5 s outlives two of them. What the server
did is read from its /metrics.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import TINY_MODEL, Pki
from tests.servers import (
    MetricSamples,
    RunningServer,
    free_port,
    metric_samples,
    start_server,
    wait_for_metric,
)
from tools.stress import StressConfig, format_table, run_suite
from tools.stress.__main__ import main
from tools.stress.phases import PHASES, StressContext
from tools.stress.result import Tally
from tools.stress.streams import STREAM_RECYCLED

MAX_RESPONSE_BYTES = 768 * 1024
ANSWER_BUDGET_BYTES = 3 * 512 * 1024
CONNECTION_AGE_S = 2
STREAM_SECONDS = 5.0
SCALE = 0.1
LOOP_LAG_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, float("inf"))


@pytest.fixture(scope="module")
def answers_server(tiny_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    log_path = tmp_path_factory.mktemp("stress-phases-server") / "server.log"
    health_port = free_port()
    server = start_server(
        tiny_repository,
        log_path,
        *("--max-response-bytes", str(MAX_RESPONSE_BYTES)),
        *("--max-answer-bytes-in-flight", str(ANSWER_BUDGET_BYTES)),
        *("--max-connection-age-s", str(CONNECTION_AGE_S)),
        *("--health-port", str(health_port)),
        health_target=f"127.0.0.1:{health_port}",
    )
    try:
        yield server
    finally:
        server.stop()


def _config(server: RunningServer, **changes: object) -> StressConfig:
    values: dict[str, object] = {
        "target": server.target,
        "model": TINY_MODEL,
        "scale": SCALE,
        "safety_timeout_s": 30.0,
        "metrics_url": server.metrics_url,
        "http_target": f"127.0.0.1:{server.http_port}",
        "stream_seconds": STREAM_SECONDS,
    }
    return StressConfig(**{**values, **changes})


async def _run_phase(name: str, config: StressConfig) -> Tally:
    (phase,) = (phase for phase in PHASES if phase.name == name)
    tally = Tally()
    await phase.run(StressContext(config, random.Random(config.seed), None), tally)
    return tally


def _total(samples: MetricSamples, name: str, **labels: str) -> float:
    """A metric summed over every sample carrying these labels."""
    return sum(
        value for (sample, items), value in samples.items() if sample == name and labels.items() <= dict(items).items()
    )


def _delta(before: MetricSamples, after: MetricSamples, name: str, **labels: str) -> float:
    return _total(after, name, **labels) - _total(before, name, **labels)


async def test_oversized_answers_are_refused_before_running(answers_server: RunningServer) -> None:
    before = metric_samples(answers_server)
    tally = await _run_phase("oversized_answers", _config(answers_server))
    after = metric_samples(answers_server)
    http_refused, grpc_refused = tally.outcomes["HTTP 413"], tally.outcomes["RESOURCE_EXHAUSTED"]
    assert http_refused >= 4 and grpc_refused >= 4, tally
    assert set(tally.outcomes) == {"HTTP 413", "RESOURCE_EXHAUSTED"}, tally
    # Every one refused by the response limit, and not one row run through the model.
    reason = "encoder_requests_rejected_total"
    assert _delta(before, after, reason, reason="response_too_large") == http_refused + grpc_refused
    assert _delta(before, after, "encoder_sequences_total") == 0
    route = "/v2/models/{name}/infer"
    assert _delta(before, after, "encoder_http_requests_total", route=route, status="413") == http_refused


async def test_slow_readers_of_big_answers_hold_the_budget_and_the_rest_are_refused(
    answers_server: RunningServer,
) -> None:
    before = metric_samples(answers_server)
    tally = await _run_phase("slow_readers_big_answers", _config(answers_server))
    after = metric_samples(answers_server)
    held, refused = tally.outcomes["HELD"], tally.outcomes["TRAILERS_ONLY"] + tally.outcomes["HTTP 429"]
    assert set(tally.outcomes) <= {"HELD", "TRAILERS_ONLY", "PENDING", "HTTP 200", "HTTP 429"}, tally
    # Zero-window readers hold their answers' bytes: at most three of 512 KiB fit the 1.5 MiB budget.
    assert 1 <= held <= 3, tally
    assert refused >= 1, tally
    assert _delta(before, after, "encoder_requests_rejected_total", reason="answer_budget") == refused
    # Once the readers let go, their answers leave the budget and nothing is left in flight.
    wait_for_metric(answers_server, "encoder_answer_bytes_in_flight", 0)
    wait_for_metric(answers_server, "encoder_inflight_requests", 0, model=TINY_MODEL, version="1")


async def test_a_stream_outlives_connection_recycles_with_every_request_answered(
    answers_server: RunningServer,
) -> None:
    before = metric_samples(answers_server)
    tally = await _run_phase("stream_recycle", _config(answers_server))
    after = metric_samples(answers_server)
    # Two connection ages in 5 s: the server ended the stream UNAVAILABLE telling the client to reopen it.
    assert tally.outcomes[STREAM_RECYCLED] >= 2, (tally.outcomes, tally.notes)
    assert set(tally.outcomes) == {"OK", STREAM_RECYCLED}, (tally.outcomes, tally.notes)
    # Every answer the server sent OK reached the client, once.
    answered = _delta(before, after, "encoder_requests_total", model=TINY_MODEL, code="OK")
    assert answered == tally.outcomes["OK"] > 0


async def test_the_suite_reports_loop_lag_health_and_refusals_per_phase(answers_server: RunningServer) -> None:
    before = metric_samples(answers_server)
    result = await run_suite(_config(answers_server, phases=("oversized_answers",)))
    after = metric_samples(answers_server)
    phase, final = result.phases
    assert phase.name == "oversized_answers" and final.outcomes == {"OK": 1}
    # The lag is one of the server's bucket bounds, and the refusals its own counts (the probe's included).
    assert phase.loop_lag_max_s in LOOP_LAG_BOUNDS
    refused = _delta(before, after, "encoder_requests_rejected_total", reason="response_too_large")
    assert phase.refusals == {"response_too_large": refused} and refused == phase.sent
    assert phase.health.outcomes.keys() <= {"OK"} and phase.health.sent > 0
    assert 0 < phase.health.p50_ms <= phase.health.p99_ms <= phase.health.max_ms
    table = format_table(result)
    assert "health ms p50/p99/max" in table and "loop lag <= s" in table and "response_too_large" in table
    document = result.to_dict()
    assert document["phases"][0]["loop_lag_max_s"] == phase.loop_lag_max_s
    assert document["health"] and document["config"]["http_target"] == f"127.0.0.1:{answers_server.http_port}"


async def test_health_is_checked_where_the_health_target_says(answers_server: RunningServer) -> None:
    """On the server's plaintext health port when given (as kubelet probes); a port nobody serves fails every check."""
    on_health_port = await run_suite(
        _config(answers_server, phases=("baseline",), health_target=answers_server.health_target)
    )
    assert answers_server.health_target != answers_server.target
    phase = on_health_port.phases[0]
    assert phase.health.sent > 0 and phase.health.outcomes.keys() == {"OK"}
    assert on_health_port.to_dict()["config"]["health_target"] == answers_server.health_target
    nowhere = await run_suite(_config(answers_server, phases=("baseline",), health_target=f"127.0.0.1:{free_port()}"))
    phase = nowhere.phases[0]
    assert phase.health.sent > 0 and phase.health.outcomes.keys() == {"UNAVAILABLE"}
    # The load and the probe still went to the gRPC port.
    assert phase.probe.outcomes.keys() == {"OK"}


def test_a_bad_or_unreachable_http_target_exits_2(answers_server: RunningServer, capsys: pytest.CaptureFixture) -> None:
    assert main(["--target", answers_server.target, "--http-target", "no-port"]) == 2
    assert "http_target must be host:port" in capsys.readouterr().err
    assert main(["--target", answers_server.target, "--health-target", "8003"]) == 2
    assert "health_target must be host:port" in capsys.readouterr().err
    assert main(["--target", answers_server.target, "--stream-seconds", "0"]) == 2
    assert "stream_seconds must be positive" in capsys.readouterr().err
    # The gRPC port given as the HTTP one: it does not answer HTTP/1.1's readiness route with 200.
    arguments = ["--model", TINY_MODEL, "--http-target", answers_server.target, "--safety-timeout-s", "5"]
    assert main(["--target", answers_server.target, *arguments]) == 2
    assert "the HTTP port" in capsys.readouterr().err


async def test_raw_http_readers_speak_tls_and_send_the_key(tls_server: RunningServer, pki: Pki) -> None:
    # The HTTP/1.1 slow readers are hand-made too: with TLS and a key their requests must reach the
    # model and be answered 200 (the answer then waits on the reader), not be refused at the door.
    config = _config(tls_server, security=pki.security(api_key=True), metrics_url=None)
    before = metric_samples(tls_server)
    tally = await _run_phase("slow_readers_big_answers", config)
    after = metric_samples(tls_server)
    assert tally.outcomes.keys() == {"HELD", "HTTP 200"}, tally
    route = "/v2/models/{name}/infer"
    assert _delta(before, after, "encoder_http_requests_total", route=route, status="200") == tally.outcomes["HTTP 200"]
