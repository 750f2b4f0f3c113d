"""Triton's perf_analyzer (tritonclient 2.41.1's binary) drives the server: tokens, text and --streaming over
gRPC, tokens and text over KServe REST on the HTTP port.

Short runs: three windows of a few dozen requests at concurrency 1, then 8. Zero errors is judged
by perf_analyzer itself (exit status, no failed request in its output) and by the server's own
statistics (no failed request counted while it ran).
"""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from protocol import grpc_service_pb2 as pb
from protocol import grpc_service_pb2_grpc as pb_grpc
from service.pipeline.vocabulary import TEXT_INPUT
from tests.conftest import TINY_MODEL
from tests.servers import RunningServer
from tools.loadtest.corpus import load_corpus
from tools.perf_analyzer import MODES, InputData, command, protocol_of, run, write_input_data

REQUESTS_PER_WINDOW = 40
WINDOWS = 3
# count_windows of a fixed size; a stability bar every run meets, so three windows are measured.
MEASUREMENT = (
    *("--measurement-mode", "count_windows", "--measurement-request-count", str(REQUESTS_PER_WINDOW)),
    *("--stability-percentage", "1000", "--max-trials", str(WINDOWS)),
)


@pytest.fixture(scope="module")
def input_data(tiny_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> InputData:
    return write_input_data(tiny_repository / TINY_MODEL, tmp_path_factory.mktemp("perf-data"), load_corpus("short"))


def _statistics(server: RunningServer) -> pb.InferStatistics:
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        (model,) = stub.ModelStatistics(pb.ModelStatisticsRequest(name=TINY_MODEL), timeout=10).model_stats
    return model.inference_stats


@pytest.mark.parametrize("mode", MODES)
def test_perf_analyzer_runs_at_concurrency_1_and_8_without_errors(
    mode: str, tiny_server: RunningServer, input_data: InputData, tmp_path: Path
) -> None:
    before = _statistics(tiny_server)
    csv_path = tmp_path / f"{mode}.csv"
    protocol = protocol_of(mode)
    arguments = command(
        f"127.0.0.1:{tiny_server.http_port}" if protocol == "http" else tiny_server.target,
        TINY_MODEL,
        input_data.for_mode(mode),
        "1:8:7",
        csv_path,
        protocol=protocol,
        streaming=mode == "streaming",
        measurement=MEASUREMENT,
    )

    measurements = run(arguments, csv_path)  # raises with perf_analyzer's output on any failed request

    after = _statistics(tiny_server)
    assert sorted(m.concurrency for m in measurements) == [1, 8]  # perf_analyzer's CSV is by throughput
    assert after.fail.count == before.fail.count
    # Every measured window's requests were answered, and perf_analyzer read a server-side breakdown.
    assert after.success.count - before.success.count >= 2 * WINDOWS * REQUESTS_PER_WINDOW
    for measurement in measurements:
        assert measurement.throughput > 0
        assert measurement.server_compute_infer_us > 0 and measurement.server_compute_input_us > 0


def test_input_data_holds_the_same_sentences_as_text_and_as_the_models_tokens(input_data: InputData) -> None:
    text_steps = json.loads(input_data.text.read_text())["data"]
    token_steps = json.loads(input_data.tokens.read_text())["data"]
    assert len(text_steps) == len(token_steps) == len(load_corpus("short"))
    assert [step[TEXT_INPUT]["content"] for step in text_steps] == [[s] for s in load_corpus("short")]
    for step in token_steps:
        ids, mask = step["input_ids"], step["attention_mask"]
        assert ids["shape"] == mask["shape"] == [len(ids["content"])]
        assert ids["content"][0] == 101 and ids["content"][-1] == 102 and set(mask["content"]) == {1}
