"""ModelStreamInfer over real gRPC: order and ids, per-message errors, flow control, the drain and the age bound."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton

from client.protocol import output_array, text_request, token_request
from protocol import grpc_service_pb2 as pb
from protocol import grpc_service_pb2_grpc as pb_grpc
from service.envelope import Envelope
from service.errors import INTERNAL_MESSAGE, Overloaded
from service.frontends.grpc.interceptor import ErrorInterceptor, StreamBehaviour
from service.frontends.grpc.streaming import (
    ANSWER_WINDOW_S,
    MAX_INFLIGHT_PER_STREAM,
    STREAM_ENDED_MESSAGE,
    UNANSWERED_MESSAGE,
    InferenceStreams,
)
from service.frontends.grpc.transport import STREAM_AGE_SHARE, grpc_options
from service.ops.settings import Settings
from service.pipeline.api import Pipeline
from tests.conftest import TINY_MODEL
from tests.servers import (
    RunningServer,
    metric_samples,
    metric_value,
    start_server,
    wait_for_metric,
    wait_for_queue_depth,
)

LABELS = {"model": TINY_MODEL, "version": "1"}
MAX_AGED_STREAM_REQUESTS = 50_000
"""Bounds the requests one test stream sends; far more than a tiny model answers within the age tested."""


def _with_id(request: pb.ModelInferRequest, request_id: str) -> pb.ModelInferRequest:
    request.id = request_id
    return request


@pytest.fixture(scope="module")
def stub(tiny_server: RunningServer) -> pb_grpc.GRPCInferenceServiceStub:
    channel = grpc.insecure_channel(tiny_server.target)
    yield pb_grpc.GRPCInferenceServiceStub(channel)
    channel.close()


def test_answers_come_in_request_order_with_ids_and_each_requests_own_rows(
    stub: pb_grpc.GRPCInferenceServiceStub,
) -> None:
    # Lengths and row counts vary, so requests land in different batches and finish out of order.
    texts = [
        [f"sentence {i} " + "word " * (i * 7 % 23)] + (["and a second row"] if i % 3 == 0 else []) for i in range(24)
    ]
    requests = [_with_id(text_request(TINY_MODEL, chunk), f"request-{i}") for i, chunk in enumerate(texts)]
    expected = [output_array(stub.ModelInfer(request, timeout=30), "embedding") for request in requests]

    responses = list(stub.ModelStreamInfer(iter(requests), timeout=60))

    assert [r.infer_response.id for r in responses] == [r.id for r in requests]
    for response, embedding in zip(responses, expected, strict=True):
        assert response.error_message == ""
        np.testing.assert_allclose(output_array(response.infer_response, "embedding"), embedding, atol=1e-6)


def test_a_bad_message_gets_its_error_and_id_and_the_stream_goes_on(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    unknown_output = text_request(TINY_MODEL, ["fine text"])
    unknown_output.outputs.add(name="logits")
    requests = [
        _with_id(text_request(TINY_MODEL, ["first"]), "good-1"),
        _with_id(text_request(TINY_MODEL, [" "]), "empty-text"),
        _with_id(text_request("no-such-model", ["text"]), "unknown-model"),
        _with_id(token_request(TINY_MODEL, np.array([[101, 99999, 102]]), np.ones((1, 3), dtype=np.int64)), "bad-id"),
        _with_id(unknown_output, "unknown-output"),
        _with_id(text_request(TINY_MODEL, ["last"]), "good-2"),
    ]
    responses = list(stub.ModelStreamInfer(iter(requests), timeout=60))  # ends OK: no RpcError raised

    by_id = {r.infer_response.id: r for r in responses}
    assert [r.infer_response.id for r in responses] == [r.id for r in requests]
    assert by_id["good-1"].error_message == "" and by_id["good-2"].error_message == ""
    assert output_array(by_id["good-2"].infer_response, "embedding").shape[0] == 1
    assert "empty" in by_id["empty-text"].error_message
    assert "unknown model" in by_id["unknown-model"].error_message
    assert by_id["unknown-model"].infer_response.model_name == "no-such-model"
    assert "vocabulary" in by_id["bad-id"].error_message
    assert "unknown output" in by_id["unknown-output"].error_message
    for response in (by_id[name] for name in ("empty-text", "unknown-model", "bad-id", "unknown-output")):
        assert not response.infer_response.outputs


def test_tritonclient_streams_with_ids(tiny_server: RunningServer) -> None:
    client = triton.InferenceServerClient(tiny_server.target)
    results: list[tuple[str, np.ndarray | None, object]] = []
    done = threading.Event()

    def callback(result: triton.InferResult | None, error: object) -> None:
        results.append((result.get_response().id if result else "", result and result.as_numpy("embedding"), error))
        if len(results) == 5:
            done.set()

    client.start_stream(callback=callback)
    try:
        for index in range(5):
            tensor = triton.InferInput("text", [1, 1], "BYTES")
            tensor.set_data_from_numpy(np.array([[f"streamed text {index}".encode()]], dtype=object))
            client.async_stream_infer(TINY_MODEL, [tensor], request_id=f"triton-{index}")
        assert done.wait(60)
    finally:
        client.stop_stream()
        client.close()
    assert [(request_id, error) for request_id, _, error in results] == [(f"triton-{i}", None) for i in range(5)]
    assert all(embedding.shape == (1, 32) for _, embedding, _ in results)


def test_a_stream_holds_a_bounded_number_of_unanswered_requests(tiny_repository: Path, tmp_path: Path) -> None:
    """A producer far ahead of the model: the server reads only as many messages as it may hold.

    Batches wait for a minute or 64 rows, and fewer than 64 are sent, so nothing runs: the server
    must stop reading the stream at MAX_INFLIGHT_PER_STREAM requests while the client has sent
    all of its messages.
    """
    sent = MAX_INFLIGHT_PER_STREAM + 16
    assert sent < 64
    server = start_server(
        tiny_repository, tmp_path / "server.log", "--max-queue-delay-us", "60000000", "--max-batch-size", "64"
    )
    all_sent = threading.Event()
    release = threading.Event()

    def requests() -> Iterator[pb.ModelInferRequest]:
        for index in range(sent):
            yield _with_id(text_request(TINY_MODEL, [f"queued text {index}"]), str(index))
        all_sent.set()
        release.wait(60)

    channel = grpc.insecure_channel(server.target)
    try:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(requests(), timeout=120)
        assert all_sent.wait(60), "gRPC's client took fewer messages than sent: the test needs them all on the wire"
        wait_for_metric(server, "encoder_inflight_requests", MAX_INFLIGHT_PER_STREAM, **LABELS)
        wait_for_queue_depth(server, MAX_INFLIGHT_PER_STREAM, TINY_MODEL)
        call.cancel()
        # Exactly the held requests ever reached the model's queue; they leave it as cancelled.
        wait_for_metric(server, "encoder_requests_total", MAX_INFLIGHT_PER_STREAM, code="CANCELLED", **LABELS)
        wait_for_metric(server, "encoder_requests_dropped_total", MAX_INFLIGHT_PER_STREAM, reason="cancelled", **LABELS)
        wait_for_metric(server, "encoder_inflight_requests", 0, **LABELS)
    finally:
        release.set()
        channel.close()
        server.stop()


def test_drain_answers_accepted_messages_then_ends_the_stream(tiny_repository: Path, tmp_path: Path) -> None:
    accepted = 5
    # Batches wait 5 s for company: the accepted requests are still queued when the drain begins.
    server = start_server(
        tiny_repository, tmp_path / "server.log", "--max-queue-delay-us", "5000000", "--drain-timeout-s", "30"
    )
    release = threading.Event()

    def requests() -> Iterator[pb.ModelInferRequest]:
        for index in range(accepted):
            yield _with_id(text_request(TINY_MODEL, [f"accepted text {index}"]), f"accepted-{index}")
        release.wait(60)  # the stream stays open: only the server can end it

    channel = grpc.insecure_channel(server.target)
    responses = []
    try:
        call = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(requests(), timeout=120)
        wait_for_queue_depth(server, accepted, TINY_MODEL)
        server.terminate()
        with pytest.raises(grpc.RpcError) as ended:
            responses.extend(call)
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
        assert ended.value.details() == STREAM_ENDED_MESSAGE
        assert server.stop() == 0
    finally:
        release.set()
        channel.close()
        server.stop()
    assert [r.infer_response.id for r in responses] == [f"accepted-{i}" for i in range(accepted)]
    assert all(r.error_message == "" and r.infer_response.raw_output_contents for r in responses)


def test_a_stream_past_its_connections_age_answers_every_accepted_request_then_ends(
    tiny_repository: Path, tmp_path: Path
) -> None:
    """A client sends without pause past its connection's age: the server stops reading at the stream's age,
    answers all it accepted, and ends the stream UNAVAILABLE; the model ran exactly the requests answered.
    """
    server = start_server(tiny_repository, tmp_path / "server.log", "--max-connection-age-s", "3")
    stream_over = threading.Event()
    sent: list[str] = []

    def requests() -> Iterator[pb.ModelInferRequest]:
        for index in range(MAX_AGED_STREAM_REQUESTS):
            if stream_over.is_set():
                return
            sent.append(f"aged-{index}")
            yield _with_id(text_request(TINY_MODEL, [f"aged text {index}"]), sent[-1])

    # A connection of its own, opened for the stream (gRPC would share one opened earlier to the same port).
    channel = grpc.insecure_channel(server.target, options=[("grpc.use_local_subchannel_pool", 1)])
    responses = []
    try:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        ran_before = metric_value(metric_samples(server), "encoder_requests_total", code="OK", **LABELS)
        call = stub.ModelStreamInfer(requests(), timeout=120)
        with pytest.raises(grpc.RpcError) as ended:
            responses.extend(call)
        stream_over.set()
        outcome = (ended.value.code(), ended.value.details())
        assert outcome == (grpc.StatusCode.UNAVAILABLE, STREAM_ENDED_MESSAGE), f"the stream ended {outcome}"
        ran = metric_value(metric_samples(server), "encoder_requests_total", code="OK", **LABELS) - ran_before
        assert ran == len(responses) > 0  # every request that reached the model was answered
        assert [r.infer_response.id for r in responses] == sent[: len(responses)]
        assert all(r.error_message == "" for r in responses)

        again = [_with_id(text_request(TINY_MODEL, [f"new stream {i}"]), f"again-{i}") for i in range(3)]
        answers = list(stub.ModelStreamInfer(iter(again), timeout=30))
        assert [(a.infer_response.id, a.error_message) for a in answers] == [(f"again-{i}", "") for i in range(3)]
    finally:
        stream_over.set()
        channel.close()
        server.stop()


@pytest.mark.parametrize("max_connection_age_s", [0.5, 3, 300, 3600])
def test_a_connection_outlives_every_stream_begun_on_it(max_connection_age_s: float) -> None:
    # A stream may begin just before its connection's GOAWAY: the grace after it must cover the
    # stream's age and its answer window, with time left to send the last answers.
    settings = Settings(max_connection_age_s=max_connection_age_s)
    options = dict(grpc_options(settings, settings.max_message_bytes))
    grace_s = options["grpc.max_connection_age_grace_ms"] / 1000
    assert grace_s >= max_connection_age_s * STREAM_AGE_SHARE + ANSWER_WINDOW_S + 5


@asynccontextmanager
async def stream_door(behaviour: StreamBehaviour) -> AsyncIterator[grpc.aio.StreamStreamMultiCallable]:
    """ModelStreamInfer served by `behaviour` behind the error door, on a loopback port: its client call."""
    handler = grpc.stream_stream_rpc_method_handler(
        behaviour,
        request_deserializer=pb.ModelInferRequest.FromString,
        response_serializer=pb.ModelStreamInferResponse.SerializeToString,
    )
    door = Envelope(Pipeline(Settings(model_repository=Path("."))), api_keys=None)
    server = grpc.aio.server(interceptors=[ErrorInterceptor(door)])
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("inference.GRPCInferenceService", {"ModelStreamInfer": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer
    finally:
        await server.stop(grace=None)


async def answers_until_ended(
    behaviour: StreamBehaviour, ids: list[str], model: str = ""
) -> tuple[list[pb.ModelStreamInferResponse], grpc.aio.AioRpcError]:
    """Send requests with these ids over a stream served by `behaviour`, keeping the client's side open
    (so no write races the server's end, which grpc.aio would report as INTERNAL): the answers, and how
    the server ended the stream."""
    client_done = asyncio.Event()

    async def requests() -> AsyncIterator[pb.ModelInferRequest]:
        for request_id in ids:
            yield pb.ModelInferRequest(model_name=model, id=request_id)
        await client_done.wait()

    answers = []
    async with stream_door(behaviour) as model_stream_call:
        try:
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                async for answer in model_stream_call(requests()):
                    answers.append(answer)
        finally:
            client_done.set()
    return answers, ended.value


async def test_an_aged_stream_answers_a_request_it_cannot_finish_in_time_with_an_error() -> None:
    stuck_cancelled = asyncio.Event()

    async def infer(request: pb.ModelInferRequest, deadline: float | None) -> pb.ModelInferResponse:
        if request.id.startswith("stuck"):
            try:
                await asyncio.Event().wait()  # never answered
            except asyncio.CancelledError:
                stuck_cancelled.set()
                raise
        return pb.ModelInferResponse(model_name=request.model_name, id=request.id)

    streams = InferenceStreams(infer, max_inflight=4, max_age_s=1.0, answer_window_s=0.2)

    async def model_stream_infer(
        requests: AsyncIterator[pb.ModelInferRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        async for response in streams.serve(requests, context):
            yield response

    answers, ended = await answers_until_ended(model_stream_infer, ["fast-0", "stuck-1", "fast-2"], "fake")
    assert (ended.code(), ended.details()) == (grpc.StatusCode.UNAVAILABLE, STREAM_ENDED_MESSAGE)
    assert [(a.infer_response.id, a.error_message) for a in answers] == [
        ("fast-0", ""),
        ("stuck-1", UNANSWERED_MESSAGE),
        ("fast-2", ""),
    ]
    assert stuck_cancelled.is_set()


@pytest.mark.parametrize(
    ("failure", "status", "details"),
    [
        (RuntimeError("a bug in the stream"), grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE),
        (Overloaded("too busy"), grpc.StatusCode.RESOURCE_EXHAUSTED, "too busy"),
    ],
)
async def test_the_door_gives_a_failing_stream_a_precise_status(
    failure: Exception, status: grpc.StatusCode, details: str
) -> None:
    async def failing(
        requests: AsyncIterator[pb.ModelInferRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        async for request in requests:
            yield pb.ModelStreamInferResponse(infer_response=pb.ModelInferResponse(id=request.id))
            raise failure

    answers, ended = await answers_until_ended(failing, ["first"])
    assert [a.infer_response.id for a in answers] == ["first"]
    assert (ended.code(), ended.details()) == (status, details)
