"""Requests that leave the queue before running: client cancellation, gRPC deadlines, Triton's `timeout`.

One server holds work in its queue on purpose: a batching delay of 600 s and a batch of 3 rows,
so a one-row request waits until the test sends two more rows. Nothing here waits on a clock:
each test learns what the server did from /metrics, and releases what it held by filling the
batch.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from protocol import grpc_service_pb2 as pb
from protocol import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import TINY_MODEL
from tests.servers import (
    MetricSamples,
    RunningServer,
    metric_samples,
    metric_value,
    start_server,
    wait_for_metric,
    wait_for_queue_depth,
)

LABELS = {"model": TINY_MODEL, "version": "1"}
BATCH_ROWS = 3
HOLD = ("--max-queue-delay-us", "600000000", "--max-batch-size", str(BATCH_ROWS))
ANSWER_TIMEOUT_S = 60
"""Bounds the wait for an answer that should come; a server that hangs fails the test instead of blocking it."""


def text_request(*texts: bytes, timeout_us: int | None = None) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=TINY_MODEL)
    request.inputs.add(name="text", datatype="BYTES", shape=[len(texts)])
    request.raw_input_contents.append(b"".join(struct.pack("<I", len(text)) + text for text in texts))
    if timeout_us is not None:
        request.parameters["timeout"].int64_param = timeout_us
    return request


def value(samples: MetricSamples, name: str, **labels: str) -> float:
    return metric_value(samples, name, **LABELS, **labels)


@pytest.fixture(scope="module")
def held_server(tiny_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    server = start_server(tiny_repository, tmp_path_factory.mktemp("held-server") / "server.log", *HOLD)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def stub(held_server: RunningServer) -> Iterator[pb_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(held_server.target) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


@pytest.fixture
def held(held_server: RunningServer, stub: pb_grpc.GRPCInferenceServiceStub) -> Iterator[grpc.Future]:
    """A one-row request (no deadline) waiting in the queue for a fuller batch; cancelled if a test leaves it."""
    future = stub.ModelInfer.future(text_request(b"held until the batch fills"))
    try:
        wait_for_queue_depth(held_server, 1, TINY_MODEL)
        yield future
    finally:
        future.cancel()


def release(stub: pb_grpc.GRPCInferenceServiceStub, held: grpc.Future) -> None:
    """Fill the held request's batch with two more rows: both requests must then be answered."""
    filler = stub.ModelInfer(text_request(b"filler one", b"filler two"), timeout=ANSWER_TIMEOUT_S)
    assert len(filler.raw_output_contents) == 2
    assert len(held.result(timeout=ANSWER_TIMEOUT_S).raw_output_contents) == 2


def assert_only_the_answered_rows_ran(before: MetricSamples, server: RunningServer) -> None:
    """The model ran the held row and the two filler rows, nothing else; nothing is left queued or in flight."""
    after = metric_samples(server)
    assert value(after, "encoder_sequences_total") - value(before, "encoder_sequences_total") == BATCH_ROWS
    assert value(after, "encoder_queue_depth") == 0
    assert value(after, "encoder_inflight_requests") == 0


def test_a_cancelled_request_leaves_the_queue_at_once_and_never_runs(
    held_server: RunningServer, stub: pb_grpc.GRPCInferenceServiceStub, held: grpc.Future
) -> None:
    before = metric_samples(held_server)
    doomed = stub.ModelInfer.future(text_request(b"cancelled by its client"))
    wait_for_queue_depth(held_server, 2, TINY_MODEL)
    wait_for_metric(held_server, "encoder_inflight_requests", 2, **LABELS)

    assert doomed.cancel()
    assert doomed.cancelled() and doomed.code() == grpc.StatusCode.CANCELLED

    # The server notices: the request leaves the queue (not at the next batch, which is 600 s away),
    # is counted as cancelled, and no longer counts as in flight.
    cancelled = value(before, "encoder_requests_dropped_total", reason="cancelled") + 1
    wait_for_metric(held_server, "encoder_requests_dropped_total", cancelled, reason="cancelled", **LABELS)
    wait_for_queue_depth(held_server, 1, TINY_MODEL)
    wait_for_metric(held_server, "encoder_inflight_requests", 1, **LABELS)

    release(stub, held)
    assert_only_the_answered_rows_ran(before, held_server)
    after = metric_samples(held_server)
    assert (
        value(after, "encoder_requests_total", code="CANCELLED")
        - value(before, "encoder_requests_total", code="CANCELLED")
        == 1
    )
    assert value(after, "encoder_requests_dropped_total", reason="expired") == value(
        before, "encoder_requests_dropped_total", reason="expired"
    )


def test_a_grpc_deadline_that_passes_in_the_queue_is_expired_by_the_server(
    held_server: RunningServer, stub: pb_grpc.GRPCInferenceServiceStub, held: grpc.Future
) -> None:
    before = metric_samples(held_server)
    # 2 s is ample for the request to reach the queue; it then waits behind the held batch.
    with pytest.raises(grpc.RpcError) as failure:
        stub.ModelInfer(text_request(b"short deadline"), timeout=2)
    assert failure.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    # The client's own deadline would give it DEADLINE_EXCEEDED whatever the server did: the
    # counter is the server's account, and it must say the request was queued and expired there.
    expired = value(before, "encoder_requests_dropped_total", reason="expired") + 1
    wait_for_metric(held_server, "encoder_requests_dropped_total", expired, reason="expired", **LABELS)
    wait_for_queue_depth(held_server, 1, TINY_MODEL)
    # Answered as the client saw it, whichever clock noticed first: the batcher's expiry or gRPC's cancellation.
    answered = value(before, "encoder_requests_total", code="DEADLINE_EXCEEDED") + 1
    wait_for_metric(held_server, "encoder_requests_total", answered, code="DEADLINE_EXCEEDED", **LABELS)

    release(stub, held)
    assert_only_the_answered_rows_ran(before, held_server)
    after = metric_samples(held_server)
    assert value(after, "encoder_requests_dropped_total", reason="cancelled") == value(
        before, "encoder_requests_dropped_total", reason="cancelled"
    )
    assert value(after, "encoder_requests_total", code="CANCELLED") == value(
        before, "encoder_requests_total", code="CANCELLED"
    )


def test_the_triton_timeout_parameter_expires_a_queued_request_without_a_client_deadline(
    held_server: RunningServer, stub: pb_grpc.GRPCInferenceServiceStub, held: grpc.Future
) -> None:
    before = metric_samples(held_server)
    timed = stub.ModelInfer.future(text_request(b"timeout parameter", timeout_us=100_000))  # no gRPC deadline
    error = timed.exception(timeout=ANSWER_TIMEOUT_S)

    # The call has no deadline, so only the server can have answered DEADLINE_EXCEEDED, and it
    # did so while the batch it waited for was still 600 s away.
    assert error is not None and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error
    after = metric_samples(held_server)
    assert (
        value(after, "encoder_requests_dropped_total", reason="expired")
        - value(before, "encoder_requests_dropped_total", reason="expired")
        == 1
    )
    assert value(after, "encoder_queue_depth") == 1

    release(stub, held)
    assert_only_the_answered_rows_ran(before, held_server)


def test_a_timeout_parameter_that_does_not_pass_leaves_the_request_to_run(
    held_server: RunningServer, stub: pb_grpc.GRPCInferenceServiceStub, held: grpc.Future
) -> None:
    before = metric_samples(held_server)
    patient = stub.ModelInfer.future(text_request(b"patient one", b"patient two", timeout_us=600_000_000))
    assert len(patient.result(timeout=ANSWER_TIMEOUT_S).raw_output_contents) == 2
    assert len(held.result(timeout=ANSWER_TIMEOUT_S).raw_output_contents) == 2
    after = metric_samples(held_server)
    assert value(after, "encoder_sequences_total") - value(before, "encoder_sequences_total") == BATCH_ROWS
    assert value(after, "encoder_requests_dropped_total", reason="expired") == value(
        before, "encoder_requests_dropped_total", reason="expired"
    )
