"""Priorities, tenants' default priorities and the queue's bounds, through a real server and clients we did not write.

One server holds work in its queue on purpose (a batching delay of 600 s and a batch of 3 rows: no
batch runs until 3 rows wait), behind a tenants file: `search` at the model's default priority (1),
`bulk` at priority 2, `capped` never above priority 2. A batch holds rows of one priority, the
highest waiting first, so when a query fills the batch behind two bulk rows queued before it, it
runs alone and the bulk rows keep waiting. Nothing here waits on a clock: each test learns what the
server did from /metrics and Triton's statistics, and releases what it held by filling the batch.
"""

from __future__ import annotations

import queue
import struct
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import openai
import pytest
import tritonclient.grpc as triton_grpc

from protocol import grpc_service_pb2 as pb
from protocol import grpc_service_pb2_grpc as pb_grpc
from service.ops.tenants import parse_key_file
from tests.conftest import TINY_MODEL
from tests.servers import RunningServer, metric_samples, metric_value, post_json, start_server, wait_for_queue_depth

TENANTS = """
[tenants.search]
keys = ["search-key"]

[tenants.bulk]
keys = ["bulk-key"]
priority = 2
weight = 3

[tenants.capped]
keys = ["capped-key"]
highest_priority = 2
"""
SEARCH = {"authorization": "Bearer search-key"}
BULK = {"authorization": "Bearer bulk-key"}
CAPPED = {"authorization": "Bearer capped-key"}
HOLD = ("--max-queue-delay-us", "600000000", "--max-batch-size", "3")
ANSWER_TIMEOUT_S = 60
"""Bounds the wait for an answer that should come; never what a test asserts."""


@pytest.fixture(scope="module")
def server(tiny_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    folder = tmp_path_factory.mktemp("priorities")
    (folder / "tenants.toml").write_text(TENANTS)
    arguments = (*HOLD, "--api-key-file", str(folder / "tenants.toml"))
    running = start_server(tiny_repository, folder / "server.log", *arguments)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def triton(server: RunningServer) -> Iterator[triton_grpc.InferenceServerClient]:
    client = triton_grpc.InferenceServerClient(server.target)
    try:
        yield client
    finally:
        client.close()


def text_input(*texts: str) -> list[triton_grpc.InferInput]:
    tensor = triton_grpc.InferInput("text", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([text.encode() for text in texts], dtype=object))
    return [tensor]


class Answers:
    """tritonclient's async_infer callbacks, in the order they came."""

    def __init__(self) -> None:
        self.done: queue.Queue[tuple[str, object]] = queue.Queue()

    def send(self, client: triton_grpc.InferenceServerClient, name: str, headers: dict, **options: object) -> None:
        client.async_infer(
            TINY_MODEL, text_input(name), lambda result, error: self.done.put((name, error)), headers=headers, **options
        )

    def next(self) -> tuple[str, object]:
        return self.done.get(timeout=ANSWER_TIMEOUT_S)


def statistics(server: RunningServer) -> tuple[int, int]:
    """Triton's execution and inference counts of the tiny model (tritonclient's ModelStatistics)."""
    client = triton_grpc.InferenceServerClient(server.target)
    try:
        figures = client.get_inference_statistics(TINY_MODEL, headers=SEARCH, as_json=True)["model_stats"][0]
    finally:
        client.close()
    return int(figures.get("execution_count", 0)), int(figures.get("inference_count", 0))


def test_a_query_runs_before_bulk_rows_queued_earlier(
    server: RunningServer, triton: triton_grpc.InferenceServerClient
) -> None:
    answers = Answers()
    before = statistics(server)
    answers.send(triton, "bulk one", BULK)  # priority 2: its tenant's default
    answers.send(triton, "bulk two", BULK, priority=2)
    wait_for_queue_depth(server, 2, TINY_MODEL)
    samples = metric_samples(server)
    assert metric_value(samples, "encoder_queue_rows", model=TINY_MODEL, version="1", priority="2", tenant="bulk") == 2
    answers.send(triton, "query", SEARCH)  # the third row fills the batch: the highest priority's rows alone run
    assert answers.next() == ("query", None)
    wait_for_queue_depth(server, 2, TINY_MODEL)
    executions, inferences = statistics(server)
    assert (executions - before[0], inferences - before[1]) == (1, 1)  # the bulk rows have not run

    answers.send(triton, "bulk three", BULK, priority=2)  # three bulk rows: their batch runs
    assert sorted(answers.next()[0] for _ in range(3)) == ["bulk one", "bulk three", "bulk two"]
    assert statistics(server)[0] - before[0] == 2


def test_a_priority_asked_for_beats_the_tenants_default_over_a_stream(server: RunningServer) -> None:
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        outgoing: queue.Queue[pb.ModelInferRequest | None] = queue.Queue()
        stream = stub.ModelStreamInfer(iter(outgoing.get, None), metadata=tuple(SEARCH.items()))
        for number in range(2):
            outgoing.put(stream_request(f"streamed bulk {number}", request_id=str(number), priority=2))
        wait_for_queue_depth(server, 2, TINY_MODEL)
        # The bulk tenant asks for priority 1 itself: its tenant's default is only a default.
        urgent = stub.ModelInfer(stream_request("urgent bulk", priority=1), metadata=tuple(BULK.items()))
        assert urgent.model_name == TINY_MODEL
        wait_for_queue_depth(server, 2, TINY_MODEL)
        outgoing.put(stream_request("streamed bulk 2", request_id="2", priority=2))
        ids = sorted(next(stream).infer_response.id for _ in range(3))
        outgoing.put(None)
    assert ids == ["0", "1", "2"]


def stream_request(text: str, request_id: str = "", priority: int | None = None) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=TINY_MODEL, id=request_id)
    request.inputs.add(name="text", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(struct.pack("<I", len(text.encode())) + text.encode())
    if priority is not None:
        request.parameters["priority"].int64_param = priority
    return request


def test_the_openai_sdk_sends_a_priority_in_extra_body(server: RunningServer) -> None:
    answers = Answers()
    triton = triton_grpc.InferenceServerClient(server.target)
    try:
        answers.send(triton, "bulk one", BULK)
        answers.send(triton, "bulk two", BULK)
        wait_for_queue_depth(server, 2, TINY_MODEL)
        client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="bulk-key", max_retries=0)
        answer = client.embeddings.create(model=TINY_MODEL, input=["urgent"], extra_body={"priority": 1})
        assert len(answer.data) == 1
        wait_for_queue_depth(server, 2, TINY_MODEL)
        status, _ = post_json(server, "/embed", {"inputs": "bulk three", "priority": 2}, BULK)
        assert status == 200
        assert sorted(answers.next()[0] for _ in range(2)) == ["bulk one", "bulk two"]
    finally:
        triton.close()


@pytest.mark.parametrize(
    ("route", "body", "message"),
    [
        ("/v1/embeddings", {"model": TINY_MODEL, "input": "x", "priority": 3}, "priority must be an integer from 1"),
        ("/v1/embeddings", {"model": TINY_MODEL, "input": "x", "priority": "high"}, "priority must be an integer"),
        ("/embed", {"inputs": "x", "priority": -1}, "priority must be an integer from 1"),
        ("/embed", {"inputs": "x", "timeout": -5}, "timeout must be a non-negative integer"),
        ("/v2/embed", {"model": TINY_MODEL, "texts": ["x"], "timeout": 1.5}, "timeout must be a non-negative"),
    ],
)
def test_a_bad_priority_or_timeout_is_refused_by_name_and_nothing_queued(
    server: RunningServer, route: str, body: dict, message: str
) -> None:
    status, answer = post_json(server, route, body, SEARCH)
    assert status in (400, 422), answer
    assert message in str(answer)
    assert metric_value(metric_samples(server), "encoder_queue_depth", model=TINY_MODEL, version="1") == 0


def test_a_bad_priority_over_grpc_is_invalid_argument(server: RunningServer) -> None:
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelInfer(stream_request("x", priority=7), metadata=tuple(SEARCH.items()))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "priority must be an integer from 1 (the highest) to 2" in refused.value.details()


def test_the_model_config_says_its_priority_levels(server: RunningServer) -> None:
    client = triton_grpc.InferenceServerClient(server.target)
    try:
        config = client.get_model_config(TINY_MODEL, headers=SEARCH, as_json=True)["config"]["dynamic_batching"]
    finally:
        client.close()
    assert (int(config["priority_levels"]), int(config["default_priority_level"])) == (2, 1)


def test_kserve_rest_takes_priority_as_a_parameter(server: RunningServer) -> None:
    body = {
        "inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["x"]}],
        "parameters": {"priority": 5},
    }
    status, answer = post_json(server, f"/v2/models/{TINY_MODEL}/infer", body, SEARCH)
    assert status == 400 and "parameter priority must be an integer from 1" in str(answer)


def test_a_tenant_capped_at_a_priority_waits_there_and_is_refused_a_higher_one(
    server: RunningServer, triton: triton_grpc.InferenceServerClient
) -> None:
    answers = Answers()
    answers.send(triton, "capped", CAPPED)  # names no priority: the model's default (1) is above its cap
    wait_for_queue_depth(server, 1, TINY_MODEL)
    samples = metric_samples(server)
    assert (
        metric_value(samples, "encoder_queue_rows", model=TINY_MODEL, version="1", priority="2", tenant="capped") == 1
    )

    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelInfer(stream_request("urgent", priority=1), metadata=tuple(CAPPED.items()))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    message = "parameter priority may be no higher than 2 for tenant 'capped' (its highest_priority in the tenants"
    assert message in refused.value.details()
    body = {"model": TINY_MODEL, "input": "urgent", "priority": 1}
    status, answer = post_json(server, "/v1/embeddings", body, CAPPED)
    assert status == 400 and message in str(answer)
    wait_for_queue_depth(server, 1, TINY_MODEL)  # nothing more was queued

    answers.send(triton, "capped two", CAPPED, priority=2)
    answers.send(triton, "bulk", BULK)  # three rows at priority 2: their batch runs
    assert sorted(answers.next()[0] for _ in range(3)) == ["bulk", "capped", "capped two"]


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ("highest_priority = 1.5", "highest_priority must be a whole number"),
        ("highest_priority = 0", "highest_priority must be a positive number"),
        ("priority = 1\nhighest_priority = 2", "priority 1 is above its highest_priority 2"),
    ],
)
def test_a_tenants_highest_priority_is_checked_at_load(table: str, message: str) -> None:
    with pytest.raises(ValueError, match=None) as refused:
        parse_key_file("tenants.toml", f"[tenants.a]\nkeys = ['s3cret-1']\n{table}\n")
    assert message in str(refused.value)


@pytest.mark.parametrize("route", ["/v1/embeddings", "/embed"])
def test_a_timeout_in_a_json_body_that_passes_in_the_queue_answers_504_without_running(
    server: RunningServer, route: str
) -> None:
    before = statistics(server)
    body = {"model": TINY_MODEL, "input": "late"} if route == "/v1/embeddings" else {"inputs": "late"}
    status, answer = post_json(server, route, {**body, "timeout": 100_000}, SEARCH)  # alone: its batch never fills
    assert status == 504, answer
    assert "timeout passed while it was queued" in str(answer)
    assert metric_value(metric_samples(server), "encoder_queue_depth", model=TINY_MODEL, version="1") == 0
    assert statistics(server) == before  # Triton's execution_count did not move: its row never ran
