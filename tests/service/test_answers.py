"""Answers budgeted like requests, and HTTP admission before work, against real servers on loopback.

An answer is refused before it runs when its size as sent (raw, JSON or base64) is over
--max-response-bytes (RESOURCE_EXHAUSTED, HTTP 413), or when the answers in flight would exceed
--max-answer-bytes-in-flight (RESOURCE_EXHAUSTED, HTTP 429 with Retry-After). HTTP requests past
--max-concurrent-http-requests, or for a model whose queue is full, are refused before their body is
read. Requests are held in flight by a queue delay far longer than any test: nothing here waits on
the clock.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import openai
import pytest

from protocol import grpc_service_pb2 as pb
from protocol import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import DEFAULT_MODEL, TINY_CONFIG, TINY_MODEL
from tests.servers import RunningServer, metric_samples, metric_value, start_server, wait_for_metric

SENTENCE = "a sentence long enough that its hidden states take a few kilobytes once they are written out as JSON"
HIDDEN = TINY_CONFIG.d_model
HOLD_FLAGS = ("--max-queue-delay-us", "600000000")
"""Requests wait in the queue until they fill a batch (never, here) or leave: held in flight on purpose."""


def text_request(texts: list[str], output: str = "embedding") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=TINY_MODEL)
    request.inputs.add(name="text", datatype="BYTES", shape=[len(texts)])
    request.raw_input_contents.append(b"".join(struct.pack("<I", len(t.encode())) + t.encode() for t in texts))
    request.outputs.add(name=output)
    return request


def kserve_body(texts: list[str], outputs: list[dict[str, object]] | None = None) -> bytes:
    body: dict[str, object] = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(texts)], "data": texts}]}
    if outputs is not None:
        body["outputs"] = outputs
    return json.dumps(body).encode()


def post(url: str, body: bytes, timeout_s: float = 30) -> tuple[int, dict[str, str], bytes]:
    """POST a JSON body: the status, headers (lower-case names) and body, whatever the status."""
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            return answer.status, {k.lower(): v for k, v in answer.headers.items()}, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, {k.lower(): v for k, v in error.headers.items()}, error.read()


@pytest.fixture(scope="module")
def small_answers(tiny_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A server whose answers may take 4 KiB as sent."""
    server = start_server(
        tiny_repository, tmp_path_factory.mktemp("small-answers") / "server.log", "--max-response-bytes", "4096"
    )
    try:
        yield server
    finally:
        server.stop()


def test_the_limit_counts_an_answer_as_sent_json_or_binary(small_answers: RunningServer) -> None:
    url = f"{small_answers.http_url}/v2/models/{TINY_MODEL}/infer"
    hidden_states = [{"name": "last_hidden_state"}]
    status, _, body = post(url, kserve_body([SENTENCE], hidden_states))
    assert status == 413
    message = json.loads(body)["error"]
    assert "over the limit of 4096 bytes per response (--max-response-bytes)" in message
    assert "binary outputs" in message

    binary = [{"name": "last_hidden_state", "parameters": {"binary_data": True}}]
    status, headers, body = post(url, kserve_body([SENTENCE], binary))
    assert status == 200
    header_length = int(headers["inference-header-content-length"])
    (output,) = json.loads(body[:header_length])["outputs"]
    assert output["parameters"]["binary_data_size"] == len(body) - header_length <= 4096
    assert output["shape"][2] == HIDDEN

    with grpc.insecure_channel(small_answers.target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        answer = stub.ModelInfer(text_request([SENTENCE], "last_hidden_state"), timeout=30)
        assert len(answer.raw_output_contents[0]) == len(body) - header_length  # the same answer, raw
        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelInfer(text_request([SENTENCE] * 4, "last_hidden_state"), timeout=30)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "(--max-response-bytes)" in refused.value.details()


def test_openai_float_answers_are_counted_as_json_and_base64_as_base64(small_answers: RunningServer) -> None:
    client = openai.OpenAI(base_url=f"{small_answers.http_url}/v1", api_key="unused", max_retries=0)
    texts = [f"text number {index}" for index in range(12)]  # 12 x 32 values: 6 KiB as JSON, 2 KiB in base64
    with pytest.raises(openai.APIStatusError) as refused:
        client.embeddings.create(model=TINY_MODEL, input=texts, encoding_format="float")
    assert refused.value.status_code == 413
    assert "(--max-response-bytes)" in refused.value.message
    answer = client.embeddings.create(model=TINY_MODEL, input=texts, encoding_format="base64")
    assert len(answer.data) == len(texts)


def test_a_tokenize_answer_over_the_limit_is_refused_413(small_answers: RunningServer) -> None:
    url = f"{small_answers.http_url}/tokenize"
    status, _, body = post(url, json.dumps({"inputs": [SENTENCE]}).encode())
    assert status == 200 and len(body) <= 4096
    status, _, body = post(url, json.dumps({"inputs": [SENTENCE] * 64}).encode())  # ~50 bytes a token
    assert status == 413
    answer = json.loads(body)
    assert answer["error_type"] == "Validation" and "(--max-response-bytes)" in answer["error"]
    assert post(url, json.dumps({"inputs": [SENTENCE]}).encode())[0] == 200  # still serving


def test_json_answers_are_the_float32_values_exactly(small_answers: RunningServer) -> None:
    """Values are written in their shortest exact form: read back as float32 they equal the raw answer."""
    url = f"{small_answers.http_url}/v2/models/{TINY_MODEL}/infer"
    status, _, body = post(url, kserve_body([SENTENCE], [{"name": "embedding"}]))
    assert status == 200
    values = {output["name"]: output["data"] for output in json.loads(body)["outputs"]}
    with grpc.insecure_channel(small_answers.target) as channel:
        raw = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(text_request([SENTENCE]), timeout=30)
    embedding = np.frombuffer(raw.raw_output_contents[0], "<f4")
    assert np.array_equal(np.array(values["embedding"], dtype=np.float32), embedding)


@pytest.fixture
def held_server(tiny_repository: Path, tmp_path: Path) -> Iterator[RunningServer]:
    """Answers in flight capped at 1000 bytes, one HTTP request at a time, two queue places, queued work held."""
    server = start_server(
        tiny_repository,
        tmp_path / "server.log",
        *HOLD_FLAGS,
        "--max-answer-bytes-in-flight", "1000",
        "--max-concurrent-http-requests", "1",
        "--max-queue-size", "2",
    )  # fmt: skip
    try:
        yield server
    finally:
        server.stop()


def test_answers_in_flight_are_bounded_and_released_when_they_leave(held_server: RunningServer) -> None:
    four_embeddings = 4 * HIDDEN * 4  # 512 bytes raw
    with grpc.insecure_channel(held_server.target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        held = stub.ModelInfer.future(text_request(["one", "two", "three", "four"]), timeout=60)
        wait_for_metric(held_server, "encoder_answer_bytes_in_flight", four_embeddings)
        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelInfer(text_request(["five", "six", "seven", "eight"]), timeout=30)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "(--max-answer-bytes-in-flight)" in refused.value.details()
        status, headers, _ = post(
            f"{held_server.http_url}/v2/models/{TINY_MODEL}/infer", kserve_body(["five", "six", "seven", "eight"])
        )
        assert (status, headers.get("retry-after")) == (429, "1")
        samples = metric_samples(held_server)
        assert metric_value(samples, "encoder_requests_rejected_total", reason="answer_budget") == 2
        assert metric_value(samples, "encoder_answer_bytes_capacity") == 1000

        held.cancel()  # it leaves the queue: its bytes leave the budget
        wait_for_metric(held_server, "encoder_answer_bytes_in_flight", 0)
        with pytest.raises(grpc.RpcError) as admitted:  # admitted now, and held until its deadline
            stub.ModelInfer(text_request(["five", "six", "seven", "eight"]), timeout=1)
        assert admitted.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for_metric(held_server, "encoder_answer_bytes_in_flight", 0)


def test_http_admission_answers_before_reading_the_body(held_server: RunningServer) -> None:
    # One HTTP request at a time: while one is open, the next is refused at once; the probes stay open.
    with unfinished_request(held_server, "/v1/embeddings"):
        wait_for_metric(held_server, "encoder_http_requests_active", 1)
        status, headers, body = post(f"{held_server.http_url}/v1/embeddings", b"{}")
        assert (status, headers.get("retry-after")) == (429, "1")
        assert "(--max-concurrent-http-requests)" in json.loads(body)["error"]["message"]
        assert urllib.request.urlopen(f"{held_server.http_url}/v2/health/ready", timeout=10).status == 200
    wait_for_metric(held_server, "encoder_http_requests_active", 0)

    # The queue is full: an infer body that is not even JSON is refused for the queue, never parsed.
    with grpc.insecure_channel(held_server.target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        held = [stub.ModelInfer.future(text_request([f"held {index}"]), timeout=60) for index in range(2)]
        wait_for_metric(held_server, "encoder_queue_depth", 2, model=TINY_MODEL, version="1")
        status, headers, body = post(f"{held_server.http_url}/v2/models/{TINY_MODEL}/infer", b"{not json")
        assert (status, headers.get("retry-after")) == (429, "1")
        assert "queue full" in json.loads(body)["error"]
        for future in held:
            future.cancel()
        wait_for_metric(held_server, "encoder_queue_depth", 0, model=TINY_MODEL, version="1")
    samples = metric_samples(held_server)
    assert metric_value(samples, "encoder_requests_rejected_total", reason="http_concurrency") == 1
    assert metric_value(samples, "encoder_requests_rejected_total", reason="queue_full") == 1
    assert metric_value(samples, "encoder_http_requests_total", route="/v2/models/{name}/infer", status="429") == 1


@contextlib.contextmanager
def unfinished_request(server: RunningServer, path: str) -> Iterator[None]:
    """An HTTP request whose body never finishes arriving, open on its own connection for the block."""
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as connection:
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
        connection.sendall(head.encode() + b'{"input": ')
        yield


def test_every_process_observes_its_event_loop_lag(tiny_server: RunningServer) -> None:
    """The lag histogram is fed by the server itself, every 100 ms: its count grows while nothing else happens."""
    before = metric_value(metric_samples(tiny_server), "encoder_event_loop_lag_seconds_count")
    deadline = time.monotonic() + 30
    while metric_value(metric_samples(tiny_server), "encoder_event_loop_lag_seconds_count") < before + 2:
        assert time.monotonic() < deadline, "the event loop's lag is not observed"
        time.sleep(0.05)


def test_an_http_answer_a_client_does_not_read_stays_in_the_budget(default_server: RunningServer) -> None:
    """Written in parts, an answer leaves the budget only once the connection has taken it, not when it is queued."""
    texts = [" ".join(["word"] * 300) for _ in range(8)]  # 8 rows of 256 tokens
    body = json.dumps(
        {
            "inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(texts)], "data": texts}],
            "outputs": [{"name": "last_hidden_state"}],
        }
    ).encode()
    as_json = len(texts) * 256 * 384 * 16  # the answer's size as counted: 12 MiB, far past what sockets buffer
    head = f"POST /v2/models/{DEFAULT_MODEL}/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    answered = {"model": DEFAULT_MODEL, "version": "1", "code": "OK"}
    before = metric_value(metric_samples(default_server), "encoder_requests_total", **answered)
    readers = []
    try:
        for _ in range(2):
            reader = socket.socket()
            reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # and it never reads
            reader.connect(("127.0.0.1", default_server.http_port))
            reader.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
            readers.append(reader)
        # The engine has answered both (their answers are written): the bytes are still counted.
        wait_for_metric(default_server, "encoder_requests_total", before + 2, timeout_s=120, **answered)
        samples = metric_samples(default_server)
        assert metric_value(samples, "encoder_answer_bytes_in_flight") == 2 * as_json
        assert metric_value(samples, "encoder_http_requests_active") == 2
    finally:
        for reader in readers:
            reader.close()
    wait_for_metric(default_server, "encoder_answer_bytes_in_flight", 0)


def test_a_tokenize_answer_a_client_does_not_read_stays_in_the_budget(default_server: RunningServer) -> None:
    """/tokenize's answer counts in the answers in flight, as an inference's does, until the connection takes it."""
    text, count = " ".join(["word"] * 300), 600  # 600 rows of 256 tokens, ~60 bytes each as JSON
    status, _, one = post(f"{default_server.http_url}/tokenize", json.dumps({"inputs": [text]}).encode())
    assert status == 200
    answer_bytes = 2 + count * (len(one) - 2) + count - 1  # [row,row,...]: ~9 MiB, far past what sockets buffer
    body = json.dumps({"inputs": [text] * count}).encode()
    head = "POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    with socket.socket() as reader:
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # and it never reads
        reader.connect(("127.0.0.1", default_server.http_port))
        reader.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_for_metric(default_server, "encoder_answer_bytes_in_flight", answer_bytes, timeout_s=120)
        assert metric_value(metric_samples(default_server), "encoder_http_requests_active") == 1
    wait_for_metric(default_server, "encoder_answer_bytes_in_flight", 0)
