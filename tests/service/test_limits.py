"""Every limit at the door, against a real server: the documented status, a message naming the limit, and a
server that keeps serving. Bursts far past the queue bound get RESOURCE_EXHAUSTED, never CANCELLED."""

from __future__ import annotations

import asyncio
import collections
import struct
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

from protocol import grpc_service_pb2 as pb
from protocol import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import TINY_MODEL
from tests.servers import RunningServer, start_server


def text_request(*texts: str, output: str = "embedding") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=TINY_MODEL)
    request.inputs.add(name="text", datatype="BYTES", shape=[len(texts)])
    encoded = [text.encode() for text in texts]
    request.raw_input_contents.append(b"".join(struct.pack("<I", len(item)) + item for item in encoded))
    request.outputs.add(name=output)
    return request


def counter(server: RunningServer, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


@pytest.fixture(scope="module")
def limited_server(tiny_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    server = start_server(
        tiny_repository,
        tmp_path_factory.mktemp("limited") / "server.log",
        "--max-text-bytes", "1000",
        "--max-request-text-bytes", "3000",
        "--max-message-bytes", "20000",
        "--max-response-bytes", "4096",
    )  # fmt: skip
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def stub(limited_server: RunningServer) -> Iterator[pb_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(limited_server.target) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


def refusal(stub, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        stub.ModelInfer(request, timeout=10)
    return refused.value


def test_a_text_over_the_per_text_limit_is_refused_by_name(limited_server, stub) -> None:
    before = counter(limited_server, "encoder_requests_rejected_total", reason="text_too_large")
    error = refusal(stub, text_request("short", "x" * 1001))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == ("input text[1] is 1001 bytes, over the limit of 1000 bytes per text (--max-text-bytes)")
    assert counter(limited_server, "encoder_requests_rejected_total", reason="text_too_large") == before + 1
    assert len(stub.ModelInfer(text_request("x" * 1000), timeout=10).raw_output_contents) == 1


def test_texts_over_the_per_request_total_are_refused_by_name(limited_server, stub) -> None:
    before = counter(limited_server, "encoder_requests_rejected_total", reason="request_text_too_large")
    error = refusal(stub, text_request(*["y" * 800] * 4))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "total 3200 bytes, over the limit of 3000 bytes per request (--max-request-text-bytes)" in error.details()
    assert counter(limited_server, "encoder_requests_rejected_total", reason="request_text_too_large") == before + 1


def test_a_message_over_the_size_limit_is_resource_exhausted(stub) -> None:
    ids = np.ones((1, 5000), dtype="<i8")  # 40 kB of raw contents against a 20 kB limit
    request = pb.ModelInferRequest(model_name=TINY_MODEL)
    request.inputs.add(name="input_ids", datatype="INT64", shape=[1, 5000])
    request.raw_input_contents.append(ids.tobytes())
    error = refusal(stub, request)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in error.details()
    assert len(stub.ModelInfer(text_request("still serving"), timeout=10).raw_output_contents) == 1


def test_outputs_over_the_response_limit_are_refused_before_running(limited_server, stub) -> None:
    sentence = "a sentence long enough that its hidden states outgrow a four kilobyte answer " * 2
    before = counter(limited_server, "encoder_requests_rejected_total", reason="response_too_large")
    error = refusal(stub, text_request(sentence, output="last_hidden_state"))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "per response (--max-response-bytes)" in error.details()
    assert counter(limited_server, "encoder_requests_rejected_total", reason="response_too_large") == before + 1
    assert len(stub.ModelInfer(text_request(sentence), timeout=10).raw_output_contents) == 1


def test_a_long_text_is_embedded_as_its_truncated_tokens(tiny_server: RunningServer, tiny_repository: Path) -> None:
    long_text = "Long documents are truncated at the model's maximum length. " * 800  # ~48,000 characters
    tokenizer = Tokenizer.from_file(str(tiny_repository / TINY_MODEL / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=128)
    whole = tokenizer.encode(long_text)  # what the model reads, from the whole text, never clipped
    tokens = pb.ModelInferRequest(model_name=TINY_MODEL)
    for name, values in (("input_ids", whole.ids), ("attention_mask", whole.attention_mask)):
        tokens.inputs.add(name=name, datatype="INT64", shape=[1, len(values)])
        tokens.raw_input_contents.append(np.array([values], dtype="<i8").tobytes())
    tokens.outputs.add(name="embedding")
    with grpc.insecure_channel(tiny_server.target) as channel:
        served = pb_grpc.GRPCInferenceServiceStub(channel)
        from_text = served.ModelInfer(text_request(long_text), timeout=10)
        from_tokens = served.ModelInfer(tokens, timeout=10)
    assert from_text.raw_output_contents[0] == from_tokens.raw_output_contents[0]


def test_a_request_over_the_token_budget_is_split_and_answered_whole(tiny_repository: Path, tmp_path: Path) -> None:
    server = start_server(tiny_repository, tmp_path / "server.log", "--max-batch-tokens", "64")
    try:
        texts = [f"sentence number {i} of a request larger than one batch" for i in range(20)]
        with grpc.insecure_channel(server.target) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            whole = stub.ModelInfer(text_request(*texts), timeout=10)
            alone = [stub.ModelInfer(text_request(text), timeout=10) for text in texts[:3]]
        assert list(whole.outputs[0].shape) == [20, 32]
        vectors = np.frombuffer(whole.raw_output_contents[0], dtype="<f4").reshape(20, 32)
        for index, answer in enumerate(alone):
            np.testing.assert_allclose(vectors[index], np.frombuffer(answer.raw_output_contents[0], "<f4"), atol=1e-6)
        # 20 rows x 16 tokens at 64 tokens per batch: the request ran as several batches.
        assert counter(server, "encoder_batch_size_count") > 3
    finally:
        server.stop()


async def burst(target: str, count: int) -> collections.Counter:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)

        async def one(index: int) -> str:
            try:
                await stub.ModelInfer(text_request(f"burst request {index}"), timeout=60)
                return "OK"
            except grpc.aio.AioRpcError as error:
                return error.code().name

        return collections.Counter(await asyncio.gather(*(one(i) for i in range(count))))


def test_a_burst_far_past_the_queue_bound_gets_resource_exhausted_not_cancelled(
    tiny_repository: Path, tmp_path: Path
) -> None:
    # A 2 s batching window and a 32-request queue: the queue fills at once and stays full.
    server = start_server(
        tiny_repository, tmp_path / "server.log", "--max-queue-size", "32", "--max-queue-delay-us", "2000000"
    )
    try:
        statuses = asyncio.run(burst(server.target, 5000))
        assert set(statuses) <= {"OK", "RESOURCE_EXHAUSTED"}, statuses
        assert statuses["OK"] >= 32
        assert statuses["RESOURCE_EXHAUSTED"] >= 4000
        assert counter(server, "encoder_requests_rejected_total", reason="queue_full") == statuses["RESOURCE_EXHAUSTED"]
        assert counter(server, "encoder_inflight_requests") == 0
        assert counter(server, "encoder_queue_depth") == 0
    finally:
        server.stop()
