"""Hypothesis-generated requests against a live server: every answer is a precise status, and it keeps serving.

Requests range from nearly right (text and token forms with the wrong shape, size or values) to
nonsense (unknown datatypes and names, dimensions like 2**62 or negative ones, raw and typed
contents mixed, parameters of every kind); raw bytes that are not protobuf at all are sent too.
ModelStreamInfer gets both kinds as messages of a stream: each is answered in its place, in order,
and the stream ends OK.
Each call has no deadline of its own: a request the server never answers is caught by the
bounded wait on its future, not hidden behind the client's DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import math
import struct

import grpc
import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from client.protocol import text_request
from protocol import grpc_service_pb2 as pb
from protocol import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import TINY_MODEL
from tests.servers import RunningServer

ANSWER_WAIT_S = 30.0
PRECISE = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
FUZZ = settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
VOCAB_SIZE = 30522
HUGE = (2**31, 2**32 + 1, 2**62, 2**63 - 1, -(2**63))

datatypes = st.sampled_from(["BYTES", "INT64", "INT32", "FP32", "FP16", "BOOL", "UINT64", "", "NONSENSE", "int64"])
input_names = st.sampled_from(["text", "input_ids", "attention_mask", "token_type_ids", "unknown", ""]) | st.text(
    max_size=6
)
dimensions = st.integers(-3, 6) | st.sampled_from([*HUGE, 128, 129, 257])
shapes = st.lists(dimensions, max_size=4)
parameters = st.one_of(
    st.builds(pb.InferParameter, bool_param=st.booleans()),
    st.builds(pb.InferParameter, int64_param=st.integers(-(2**63), 2**63 - 1)),
    st.builds(pb.InferParameter, string_param=st.text(max_size=8)),
    st.builds(pb.InferParameter, double_param=st.floats()),
    st.builds(pb.InferParameter, uint64_param=st.integers(0, 2**64 - 1)),
)
parameter_maps = st.dictionaries(
    st.sampled_from(["timeout", "priority", "sequence_id", "binary_data_output"]) | st.text(max_size=4),
    parameters,
    max_size=3,
)
token_values = st.integers(-2, VOCAB_SIZE + 2) | st.sampled_from([0, 1, -(2**63), 2**63 - 1])
contents = st.builds(
    pb.InferTensorContents,
    bool_contents=st.lists(st.booleans(), max_size=4),
    int_contents=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=4),
    int64_contents=st.lists(token_values, max_size=8),
    uint64_contents=st.lists(st.integers(0, 2**64 - 1), max_size=2),
    fp32_contents=st.lists(st.floats(width=32), max_size=4),
    bytes_contents=st.lists(st.binary(max_size=12), max_size=4),
)


def bytes_raw(elements: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(element)) + element for element in elements)


@st.composite
def text_tensors(draw: st.DrawFn) -> tuple[pb.ModelInferRequest.InferInputTensor, bytes, pb.InferTensorContents]:
    """The text form, mostly right: BYTES elements, with a shape and datatype that may not fit them."""
    elements = draw(st.lists(st.text(max_size=30).map(str.encode) | st.binary(max_size=30), max_size=5))
    count = len(elements)
    shape = draw(st.sampled_from([[count], [count, 1], [1, count], [count, 2], []]) | shapes)
    tensor = pb.ModelInferRequest.InferInputTensor(
        name=draw(st.just("text") | input_names), datatype=draw(st.just("BYTES") | datatypes), shape=shape
    )
    raw = bytes_raw(elements)
    raw = draw(st.sampled_from([raw, raw[:-1], raw + b"\x00", raw[4:]])) if raw else raw
    return tensor, raw, pb.InferTensorContents(bytes_contents=elements)


@st.composite
def token_tensors(draw: st.DrawFn) -> tuple[pb.ModelInferRequest.InferInputTensor, bytes, pb.InferTensorContents]:
    """One token input, mostly right: INT64 [rows, length] with values in or out of range."""
    rows, length = draw(st.integers(0, 3)), draw(st.integers(0, 9))
    values = draw(st.lists(token_values, min_size=rows * length, max_size=rows * length))
    shape = draw(st.sampled_from([[rows, length], [rows * length], [length, rows]]) | shapes)
    tensor = pb.ModelInferRequest.InferInputTensor(
        name=draw(st.sampled_from(["input_ids", "attention_mask", "token_type_ids"]) | input_names),
        datatype=draw(st.just("INT64") | datatypes),
        shape=shape,
    )
    raw = np.array(values, dtype="<i8").tobytes()
    raw = draw(st.sampled_from([raw, raw[:-1], raw + b"\x00" * 8]))
    return tensor, raw, pb.InferTensorContents(int64_contents=values)


@st.composite
def nonsense_tensors(draw: st.DrawFn) -> tuple[pb.ModelInferRequest.InferInputTensor, bytes, pb.InferTensorContents]:
    """Any name, datatype, shape, parameters, raw bytes and typed contents."""
    tensor = pb.ModelInferRequest.InferInputTensor(name=draw(input_names), datatype=draw(datatypes), shape=draw(shapes))
    for name, parameter in draw(parameter_maps).items():
        tensor.parameters[name].CopyFrom(parameter)
    return tensor, draw(st.binary(max_size=64)), draw(contents)


def _outputs(draw: st.DrawFn, request: pb.ModelInferRequest) -> None:
    for name in draw(st.lists(st.sampled_from(["embedding", "last_hidden_state"]), unique=True)):
        request.outputs.add(name=name)


@st.composite
def coherent_token_requests(draw: st.DrawFn) -> pb.ModelInferRequest:
    """input_ids and attention_mask of one shape (the path that reaches the model), sometimes one value wrong."""
    rows, length = draw(st.integers(1, 3)), draw(st.integers(1, 12))
    ids = np.array(draw(st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=rows * length, max_size=rows * length)))
    mask = np.array(draw(st.lists(st.sampled_from([0, 1]), min_size=rows * length, max_size=rows * length)))
    ids, mask = ids.reshape(rows, length), mask.reshape(rows, length)
    mask[:, 0] = 1
    if draw(st.booleans()):
        target = draw(st.sampled_from([ids, mask]))
        target[draw(st.integers(0, rows - 1)), draw(st.integers(0, length - 1))] = draw(token_values)
    request = pb.ModelInferRequest(model_name=TINY_MODEL)
    raw = draw(st.booleans())
    for name, values in (("input_ids", ids), ("attention_mask", mask)):
        tensor = request.inputs.add(name=name, datatype="INT64", shape=[rows, length])
        if raw:
            request.raw_input_contents.append(values.astype("<i8").tobytes())
        else:
            tensor.contents.int64_contents.extend(values.ravel().tolist())
    _outputs(draw, request)
    return request


@st.composite
def coherent_text_requests(draw: st.DrawFn) -> pb.ModelInferRequest:
    """The text form, well formed: any Unicode (empty and blank texts included), raw or typed, [n] or [n, 1]."""
    texts = draw(st.lists(st.text(max_size=300), min_size=1, max_size=6))
    encoded = [text.encode("utf-8") for text in texts]
    shape = [len(texts), 1] if draw(st.booleans()) else [len(texts)]
    request = pb.ModelInferRequest(model_name=TINY_MODEL, model_version=draw(st.sampled_from(["", "1"])))
    tensor = request.inputs.add(name="text", datatype="BYTES", shape=shape)
    if draw(st.booleans()):
        request.raw_input_contents.append(bytes_raw(encoded))
    else:
        tensor.contents.bytes_contents.extend(encoded)
    for name, parameter in draw(st.dictionaries(st.sampled_from(["timeout", "priority"]), parameters)).items():
        request.parameters[name].CopyFrom(parameter)
    _outputs(draw, request)
    return request


@st.composite
def infer_requests(draw: st.DrawFn) -> pb.ModelInferRequest:
    """A whole request: 0-3 inputs in raw, typed or mixed form, outputs, parameters and model names."""
    request = pb.ModelInferRequest(
        model_name=draw(st.sampled_from([TINY_MODEL, TINY_MODEL, TINY_MODEL, "", "no-such-model"])),
        model_version=draw(st.sampled_from(["", "", "1", "2", "-1", "x"])),
        id=draw(st.text(max_size=8)),
    )
    for name, parameter in draw(parameter_maps).items():
        request.parameters[name].CopyFrom(parameter)
    form = draw(st.sampled_from(["raw", "typed", "mixed"]))
    tensors = draw(st.lists(text_tensors() | token_tensors() | nonsense_tensors(), max_size=3))
    for index, (tensor, raw, typed) in enumerate(tensors):
        added = request.inputs.add()
        added.CopyFrom(tensor)
        if form == "typed" or (form == "mixed" and index % 2 == 1):
            added.contents.CopyFrom(typed)
        if form in ("raw", "mixed"):
            request.raw_input_contents.append(raw)
    if draw(st.booleans()) and request.raw_input_contents:
        request.raw_input_contents.append(draw(st.binary(max_size=16)))
    for name in draw(st.lists(st.sampled_from(["embedding", "last_hidden_state", "", "logits"]), max_size=3)):
        output = request.outputs.add(name=name)
        for key, parameter in draw(parameter_maps).items():
            output.parameters[key].CopyFrom(parameter)
    return request


@pytest.fixture(scope="module")
def channel(tiny_server: RunningServer) -> grpc.Channel:
    with grpc.insecure_channel(tiny_server.target) as opened:
        yield opened


def answer(call: grpc.UnaryUnaryMultiCallable, request: object) -> tuple[grpc.StatusCode, object]:
    """Send without a deadline and wait a bounded time: (status, response or None); fails if unanswered."""
    future = call.future(request)
    try:
        return grpc.StatusCode.OK, future.result(timeout=ANSWER_WAIT_S)
    except grpc.FutureTimeoutError:
        future.cancel()
        pytest.fail(f"no answer within {ANSWER_WAIT_S:g} s to {request!r:.300}")
    except grpc.RpcError as error:
        return error.code(), None


def assert_consistent(request: pb.ModelInferRequest, response: pb.ModelInferResponse) -> None:
    """An OK answer carries each requested output once, FP32, with as many bytes as its shape needs."""
    requested = [output.name for output in request.outputs] or ["last_hidden_state", "embedding"]
    assert [output.name for output in response.outputs] == requested
    assert len(response.raw_output_contents) == len(response.outputs)
    for output, raw in zip(response.outputs, response.raw_output_contents, strict=True):
        assert output.datatype == "FP32"
        assert len(raw) == 4 * math.prod(output.shape)
        assert np.isfinite(np.frombuffer(raw, dtype="<f4")).all()


def assert_still_serving(channel: grpc.Channel) -> None:
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    response = stub.ModelInfer(text_request(TINY_MODEL, ["still serving?"]), timeout=ANSWER_WAIT_S)
    assert response.outputs[0].name == "embedding"


def test_fuzzed_requests_get_precise_statuses_and_the_server_keeps_serving(channel: grpc.Channel) -> None:
    stub = pb_grpc.GRPCInferenceServiceStub(channel)

    @FUZZ
    @given(request=coherent_text_requests() | coherent_token_requests() | infer_requests())
    def one(request: pb.ModelInferRequest) -> None:
        code, response = answer(stub.ModelInfer, request)
        event(code.name)  # the mix of answers, shown by --hypothesis-show-statistics
        assert code in PRECISE, f"{code.name} for {request!r:.500}"
        if code == grpc.StatusCode.OK:
            assert_consistent(request, response)

    one()
    assert_still_serving(channel)


def test_bytes_that_are_not_protobuf_get_precise_statuses(channel: grpc.Channel) -> None:
    # Bytes that happen to parse are a (nonsense) request like any other; bytes that do not must be
    # refused as INVALID_ARGUMENT, not reported as the server's own failure (UNKNOWN).
    raw_call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")

    @settings(max_examples=60, deadline=None, database=None)
    @given(payload=st.binary(min_size=1, max_size=200))
    def one(payload: bytes) -> None:
        code, _ = answer(raw_call, payload)
        event(code.name)
        assert code in PRECISE, f"{code.name} for {payload!r}"

    one()
    assert_still_serving(channel)


def test_a_health_watch_of_bytes_that_are_not_protobuf_is_invalid_argument(channel: grpc.Channel) -> None:
    raw_watch = channel.unary_stream("/grpc.health.v1.Health/Watch")  # identity serializers: raw bytes
    with pytest.raises(grpc.RpcError) as refused:
        list(raw_watch(b"\xff\xff\xff", timeout=ANSWER_WAIT_S))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid message" in refused.value.details()
    assert_still_serving(channel)


STREAM_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"
STREAM_FUZZ = settings(FUZZ, max_examples=40)


def stream_answers(call: grpc.StreamStreamMultiCallable, messages: list[object]) -> list[object]:
    """Send a whole stream and read every answer; fails unless the stream ends OK within ANSWER_WAIT_S."""
    try:
        return list(call(iter(messages), timeout=ANSWER_WAIT_S))
    except grpc.RpcError as error:
        pytest.fail(f"the stream ended {error.code().name}: {error.details()} for {messages!r:.500}")


def test_fuzzed_stream_requests_are_each_answered_in_order_and_the_stream_goes_on(channel: grpc.Channel) -> None:
    stub = pb_grpc.GRPCInferenceServiceStub(channel)

    @STREAM_FUZZ
    @given(requests=st.lists(coherent_text_requests() | coherent_token_requests() | infer_requests(), max_size=4))
    def one(requests: list[pb.ModelInferRequest]) -> None:
        answers = stream_answers(stub.ModelStreamInfer, requests)
        assert [a.infer_response.id for a in answers] == [r.id for r in requests]
        for request, streamed in zip(requests, answers, strict=True):
            event("OK" if not streamed.error_message else "error_message")
            assert "internal error" not in streamed.error_message, f"for {request!r:.500}"
            if not streamed.error_message:
                assert_consistent(request, streamed.infer_response)

    one()
    assert_still_serving(channel)


def test_stream_messages_that_are_not_protobuf_are_answered_in_place_and_the_stream_goes_on(
    channel: grpc.Channel,
) -> None:
    # Each message gets one answer in its place, whatever its bytes: one that does not parse is
    # refused in `error_message` (no id: it has none), and the valid request after it is answered.
    raw_stream = channel.stream_stream(STREAM_METHOD)  # identity serializers: raw bytes both ways
    valid = text_request(TINY_MODEL, ["after the garbage"])
    valid.id = "valid"

    @settings(FUZZ, max_examples=60)
    @given(payloads=st.lists(st.binary(min_size=1, max_size=200), min_size=1, max_size=4))
    def one(payloads: list[bytes]) -> None:
        answers = [
            pb.ModelStreamInferResponse.FromString(raw)
            for raw in stream_answers(raw_stream, [*payloads, valid.SerializeToString()])
        ]
        assert len(answers) == len(payloads) + 1
        for payload, streamed in zip(payloads, answers, strict=False):
            try:
                pb.ModelInferRequest.FromString(payload)
            except DecodeError:
                event("not protobuf")
                assert streamed.error_message.startswith("the request is not a valid message"), streamed
                assert streamed.infer_response == pb.ModelInferResponse()
            else:
                event("parses")
                assert "internal error" not in streamed.error_message
        assert answers[-1].infer_response.id == "valid" and not answers[-1].error_message
        assert answers[-1].infer_response.outputs[0].name == "embedding"

    one()
    assert_still_serving(channel)
