"""ModelStatistics with Triton's semantics, read through tritonclient (gRPC and HTTP) from a server of our own."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import numpy as np
import openai
import pytest
import tritonclient.grpc as triton
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException

from service.frontends import codec
from service.ops.statistics import StatisticsTables
from tests.conftest import TINY_MODEL
from tests.servers import RunningServer, metric_samples, metric_value, start_server
from tools.loadtest.corpus import load_corpus

PASSAGE_REQUESTS = 4


def text_input(texts: list[str]) -> triton.InferInput:
    tensor = triton.InferInput("text", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
    return tensor


def token_inputs(rows: int) -> list[triton.InferInput]:
    ids = np.tile(np.array([[101, 1037, 3899, 102]], dtype=np.int64), (rows, 1))
    tensors = [
        triton.InferInput("input_ids", list(ids.shape), "INT64"),
        triton.InferInput("attention_mask", list(ids.shape), "INT64"),
    ]
    tensors[0].set_data_from_numpy(ids)
    tensors[1].set_data_from_numpy(np.ones_like(ids))
    return tensors


@pytest.fixture(scope="module")
def server(tiny_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> RunningServer:
    """A server of this module's own (so its statistics count only this module's requests), with Triton's metrics."""
    log_path = tmp_path_factory.mktemp("statistics-server") / "server.log"
    running = start_server(tiny_repository, log_path, "--triton-metrics")
    try:
        yield running
    finally:
        running.stop()


def test_statistics_count_rows_requests_batches_and_failures(server: RunningServer) -> None:
    client = triton.InferenceServerClient(server.target)
    (empty,) = client.get_inference_statistics(TINY_MODEL).model_stats
    assert (empty.name, empty.version, empty.inference_count, empty.execution_count, empty.last_inference) == (
        TINY_MODEL,
        "1",
        0,
        0,
        0,
    )
    first_ms = time.time_ns() // 1_000_000
    # One at a time, so each request is a batch of its own rows.
    client.infer(TINY_MODEL, [text_input(["one", "two", "three"])])
    client.infer(TINY_MODEL, [text_input(["four"])])
    client.infer(TINY_MODEL, token_inputs(2))
    with pytest.raises(InferenceServerException, match="empty"):
        client.infer(TINY_MODEL, [text_input([" "])])
    with pytest.raises(InferenceServerException, match="unknown model"):
        client.infer("no-such-model", [text_input(["five"])])
    last_ms = time.time_ns() // 1_000_000

    (stats,) = client.get_inference_statistics(TINY_MODEL).model_stats
    inference = stats.inference_stats
    assert stats.inference_count == 6
    assert stats.execution_count == 3
    assert {b.batch_size: b.compute_infer.count for b in stats.batch_stats} == {1: 1, 2: 1, 3: 1}
    assert first_ms <= stats.last_inference <= last_ms
    assert (inference.success.count, inference.fail.count) == (3, 1)
    durations = (inference.queue, inference.compute_input, inference.compute_infer, inference.compute_output)
    assert [d.count for d in durations] == [3, 3, 3, 3]
    assert inference.fail.ns > 0 and inference.compute_infer.ns > 0 and inference.compute_input.ns > 0
    # One request a batch: each request's compute_infer is its batch's run time (nanosecond truncation aside).
    assert sum(b.compute_infer.ns for b in stats.batch_stats) <= inference.compute_infer.ns + 3
    # The same figures as the Prometheus metrics, which count at other places in the code.
    samples = metric_samples(server)
    labels = {"model": TINY_MODEL, "version": "1"}
    assert metric_value(samples, "encoder_sequences_total", **labels) == stats.inference_count
    assert metric_value(samples, "encoder_batch_size_count", **labels) == stats.execution_count
    assert metric_value(samples, "encoder_requests_total", code="OK", **labels) == inference.success.count
    assert metric_value(samples, "encoder_requests_total", code="INVALID_ARGUMENT", **labels) == inference.fail.count
    # Triton's own nv_inference_* counters carry the same figures (durations in whole microseconds).
    triton_figures = {
        "nv_inference_request_success": inference.success.count,
        "nv_inference_request_failure": inference.fail.count,
        "nv_inference_count": stats.inference_count,
        "nv_inference_exec_count": stats.execution_count,
        "nv_inference_request_duration_us": inference.success.ns // 1000,
        "nv_inference_queue_duration_us": inference.queue.ns // 1000,
        "nv_inference_compute_input_duration_us": inference.compute_input.ns // 1000,
        "nv_inference_compute_infer_duration_us": inference.compute_infer.ns // 1000,
        "nv_inference_compute_output_duration_us": inference.compute_output.ns // 1000,
    }
    assert {name: metric_value(samples, name, **labels) for name in triton_figures} == triton_figures
    assert metric_value(samples, "nv_inference_pending_request_count", **labels) == 0  # nothing queued now


def test_each_part_of_a_requests_time_holds_what_was_measured_elsewhere(server: RunningServer) -> None:
    """The durations against figures timed apart from them: the client's own clock, and the tokenizer's timer.

    compute_input is the remainder of a request's time once queue, compute_infer and compute_output
    are taken out, so the parts add up by construction; what can go wrong is where each is measured.
    Tokenising 30 passages takes milliseconds, far more than decoding and validating them: had it
    been counted anywhere but compute_input (in the queue time, or before the request's time starts),
    compute_input would fall short of encoder_tokenize_duration_seconds.
    """
    client = triton.InferenceServerClient(server.target)
    labels = {"model": TINY_MODEL, "version": "1"}
    passages = list(load_corpus("long"))  # 30 passages of ~200 words, truncated to 128 tokens: one batch
    (before,) = client.get_inference_statistics(TINY_MODEL).model_stats
    tokenize_before_s = metric_value(metric_samples(server), "encoder_tokenize_duration_seconds_sum", **labels)
    waited_ns = 0
    for _ in range(PASSAGE_REQUESTS):  # one at a time, each a batch of its own
        started_ns = time.perf_counter_ns()
        client.infer(TINY_MODEL, [text_input(passages)])
        waited_ns += time.perf_counter_ns() - started_ns
    (after,) = client.get_inference_statistics(TINY_MODEL).model_stats
    tokenize_ns = 1e9 * (
        metric_value(metric_samples(server), "encoder_tokenize_duration_seconds_sum", **labels) - tokenize_before_s
    )

    def spent_ns(name: str) -> int:
        return getattr(after.inference_stats, name).ns - getattr(before.inference_stats, name).ns

    assert after.inference_stats.success.count - before.inference_stats.success.count == PASSAGE_REQUESTS
    assert after.inference_count - before.inference_count == PASSAGE_REQUESTS * len(passages)
    # The server's time for the requests lies within the time the client waited for their answers.
    assert 0 < spent_ns("success") <= waited_ns
    # Tokenising happens between receipt and queueing: inside compute_input, whole (1 ns a request of truncation).
    assert tokenize_ns > 1e6, "the passages took under a millisecond to tokenise: too little to tell apart"
    assert spent_ns("compute_input") >= tokenize_ns - PASSAGE_REQUESTS
    # Each request ran in a batch of its own: its compute_infer is that batch's run time, timed by the batcher.
    batch_ns = {b.batch_size: b.compute_infer.ns for b in before.batch_stats}
    (grown,) = [b for b in after.batch_stats if b.compute_infer.ns != batch_ns.get(b.batch_size, 0)]
    assert grown.batch_size == len(passages)
    assert abs(spent_ns("compute_infer") - (grown.compute_infer.ns - batch_ns.get(grown.batch_size, 0))) <= (
        PASSAGE_REQUESTS
    )


def test_every_model_without_a_name_and_not_found_for_unknown_ones(server: RunningServer) -> None:
    client = triton.InferenceServerClient(server.target)
    assert [(s.name, s.version) for s in client.get_inference_statistics().model_stats] == [(TINY_MODEL, "1")]
    assert [s.name for s in client.get_inference_statistics(TINY_MODEL, "1").model_stats] == [TINY_MODEL]
    for name, version in (("no-such-model", ""), (TINY_MODEL, "7")):
        with pytest.raises(InferenceServerException) as raised:
            client.get_inference_statistics(name, version)
        assert raised.value.status() == str(grpc.StatusCode.NOT_FOUND)


def test_every_protocols_inferences_count_and_http_reads_the_same_statistics(server: RunningServer) -> None:
    grpc_client = triton.InferenceServerClient(server.target)
    http_client = triton_http.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    (before,) = grpc_client.get_inference_statistics(TINY_MODEL).model_stats

    texts = triton_http.InferInput("text", [2], "BYTES")
    texts.set_data_from_numpy(np.array([b"one", b"two"], dtype=object))
    http_client.infer(TINY_MODEL, [texts])  # KServe REST: 2 rows
    blank = triton_http.InferInput("text", [1], "BYTES")
    blank.set_data_from_numpy(np.array([b" "], dtype=object))
    with pytest.raises(InferenceServerException, match="empty"):
        http_client.infer(TINY_MODEL, [blank])  # KServe REST: a failure
    sdk = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0)
    sdk.embeddings.create(model=TINY_MODEL, input=["three", "four", "five"])  # OpenAI: 3 rows

    (after,) = grpc_client.get_inference_statistics(TINY_MODEL).model_stats
    assert after.inference_count - before.inference_count == 5
    assert after.inference_stats.success.count - before.inference_stats.success.count == 2
    assert after.inference_stats.fail.count - before.inference_stats.fail.count == 1
    assert after.inference_stats.compute_output.count == after.inference_stats.success.count

    # Triton's HTTP statistics routes answer the same figures, zero-valued fields included.
    (read,) = http_client.get_inference_statistics(TINY_MODEL)["model_stats"]
    assert http_client.get_inference_statistics(TINY_MODEL, "1")["model_stats"] == [read]
    assert http_client.get_inference_statistics()["model_stats"] == [read]  # GET /v2/models/stats: every model
    assert (read["name"], read["version"]) == (TINY_MODEL, "1")
    assert (read["inference_count"], read["execution_count"]) == (after.inference_count, after.execution_count)
    assert read["last_inference"] == after.last_inference
    for name in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output"):
        duration = getattr(after.inference_stats, name)
        assert read["inference_stats"][name] == {"count": duration.count, "ns": duration.ns}
    assert read["inference_stats"]["cache_hit"] == {"count": 0, "ns": 0}
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in read["batch_stats"]] == [
        (b.batch_size, b.compute_infer.count) for b in after.batch_stats
    ]
    for name, version in (("no-such-model", ""), (TINY_MODEL, "7")):
        with pytest.raises(InferenceServerException, match=r"unknown model|no version") as raised:
            http_client.get_inference_statistics(name, version)
        assert raised.value.status() == "404"
    http_client.close()


def test_batch_statistics_by_executed_size_and_proto_fields() -> None:
    tables = StatisticsTables()
    table = tables.of("model", "2", max_batch_size=8)
    table.record_execution(4, 0.002)
    table.record_execution(1, 0.001)
    table.record_execution(4, 0.003)
    table.record_success(rows=4, total_s=0.010, queue_s=0.004, compute_s=0.003, output_s=0.001)
    table.record_failure(0.0005)
    message = codec.model_statistics("model", "2", tables.snapshot("model", "2"))
    assert (message.name, message.version, message.inference_count, message.execution_count) == ("model", "2", 4, 3)
    assert [(b.batch_size, b.compute_infer.count, b.compute_infer.ns) for b in message.batch_stats] == [
        (1, 1, 1_000_000),
        (4, 2, 5_000_000),
    ]
    inference = message.inference_stats
    assert (inference.success.count, inference.success.ns) == (1, 10_000_000)
    assert (inference.fail.count, inference.fail.ns) == (1, 500_000)
    assert inference.queue.ns == 4_000_000 and inference.compute_infer.ns == 3_000_000
    assert inference.compute_output.ns == 1_000_000
    assert inference.compute_input.ns == pytest.approx(2_000_000, abs=1)
    assert message.last_inference > 0
