"""The stuck-run watchdog, end to end: a run past --max-batch-run-s fails its request and those queued behind
it, takes the model out of service (NOT_SERVING) until the run returns, and then the model serves again. A
two-tower model's image tower is watched as its text rows are: a stuck image batch takes the model, and the
server, out of service too.

The model here is a real ONNX graph that takes seconds for one input and microseconds for others:
a Loop of millions of empty turns when the first token id is 29999. Each step waits on an event, not
on how long something takes: the slow request is queued before its batch starts, so the request behind
it is in the queue when the watchdog fires; the health changes are pushed on a Watch stream as they
happen, not polled while they last. The one speed assumption left is that STUCK_TURNS outlast the limit.
"""

from __future__ import annotations

import io
import shutil
import struct
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image

from protocol import grpc_service_pb2 as pb
from protocol import grpc_service_pb2_grpc as pb_grpc
from service.core.repository import FIDELITY_FILE
from service.core.towers import IMAGE_FIDELITY_FILE
from service.pipeline.images import ImagePreprocessor
from tests.conftest import TINY_MODEL
from tests.export.two_tower_folders import PROJECTION, exported_two_towers
from tests.onnx_graphs import SLOW_ID, slow_on_demand_image_model, slow_on_demand_model, token_request
from tests.servers import start_server, wait_for_queue_depth

WAIT_S = 120
"""Bounds the wait for the slow run to return; a server that hangs fails the test instead of blocking it."""
BATCH_ROWS = 2
"""Rows per batch: a batch runs when two rows wait (the batching delay is ten minutes), never on a timer."""
STUCK_TURNS = 10_000_000
"""Loop turns of the slow run: 7-9 s on this project's 2-core machines (0.7-0.9 us a turn), and the run only
has to outlast --max-batch-run-s 1: a CPU would have to be about 7 times faster for this test to be wrong."""


def rows_request(rows: list[list[int]]) -> pb.ModelInferRequest:
    """A ModelInfer of rows of token ids of one length (all attended), asking for the embedding."""
    request = pb.ModelInferRequest(model_name=TINY_MODEL)
    values = [value for row in rows for value in row]
    for name, data in (("input_ids", values), ("attention_mask", [1] * len(values))):
        request.inputs.add(name=name, datatype="INT64", shape=[len(rows), len(rows[0])])
        request.raw_input_contents.append(struct.pack(f"<{len(data)}q", *data))
    request.outputs.add(name="embedding")
    return request


def row_sums(response: pb.ModelInferResponse) -> list[float]:
    """The graph's answer for each row: the sum of its ids."""
    return np.frombuffer(response.raw_output_contents[0], "<f4").reshape(response.outputs[0].shape)[:, 0].tolist()


def test_a_run_past_the_limit_fails_its_requests_and_takes_the_model_out_until_it_returns(
    repository_copy: Path, tmp_path: Path
) -> None:
    slow_on_demand_model(repository_copy / TINY_MODEL / "1" / "model.onnx", STUCK_TURNS)
    (repository_copy / TINY_MODEL / FIDELITY_FILE).unlink(missing_ok=True)  # references of the real model
    flags = ("--no-warmup", "--device", "cpu", "--max-batch-run-s", "1")
    flags += ("--max-batch-size", str(BATCH_ROWS), "--max-queue-delay-us", "600000000")
    with (
        start_server(repository_copy, tmp_path / "server.log", *flags) as server,
        grpc.insecure_channel(server.target) as channel,
    ):
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=TINY_MODEL), timeout=WAIT_S
        )
        try:
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            fast = stub.ModelInfer(rows_request([[101, 5, 102], [101, 6, 102]]), timeout=20)  # fills a batch
            assert row_sums(fast) == [101 + 5 + 102, 101 + 6 + 102]

            slow = stub.ModelInfer.future(token_request(TINY_MODEL, [SLOW_ID, 5]), timeout=WAIT_S)
            wait_for_queue_depth(server, 1, TINY_MODEL)  # queued, waiting for a second row
            # A second row fills the batch but stays out of it (a row of 2 tokens is never padded to 60): the
            # slow row runs alone, and this request waits behind it, queued before the watchdog can fire.
            queued = stub.ModelInfer.future(token_request(TINY_MODEL, [101, *[7] * 58, 102]), timeout=WAIT_S)
            with pytest.raises(grpc.RpcError) as stuck:
                slow.result()
            assert stuck.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "did not finish this request's batch within 1 s" in stuck.value.details()
            # Its only instance is still running that batch: what waited for it is refused, not left to hang.
            with pytest.raises(grpc.RpcError) as refused:
                queued.result()
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "no model instance is in service" in refused.value.details()
            # The model said it was out of service when the watchdog fired, and back when the run returned.
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        finally:
            watch.cancel()
        again = stub.ModelInfer(rows_request([[101, 7, 102], [101, 8, 102]]), timeout=20)
        assert row_sums(again) == [101 + 7 + 102, 101 + 8 + 102]
    assert server.process.returncode == 0


def image_request(model: str, colour: tuple[int, int, int]) -> pb.ModelInferRequest:
    """A ModelInfer of one PNG image of one colour, asking for the embedding."""
    buffer = io.BytesIO()
    Image.new("RGB", (20, 20), colour).save(buffer, format="PNG")
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="image", datatype="BYTES", shape=[1]).contents.bytes_contents.append(buffer.getvalue())
    request.outputs.add(name="embedding")
    return request


def test_a_stuck_image_batch_takes_the_model_and_the_server_out_until_it_returns(tmp_path: Path) -> None:
    repository = tmp_path / "repository"
    folder = repository / "clip"
    shutil.copytree(exported_two_towers() / "repository" / "clip", folder)
    size = ImagePreprocessor.from_folder(folder).output_size.height
    slow_on_demand_image_model(folder / "1" / "image.onnx", size, PROJECTION, STUCK_TURNS)  # slow on a white image
    for references in (FIDELITY_FILE, IMAGE_FIDELITY_FILE):  # of the real model's towers
        (folder / references).unlink(missing_ok=True)
    flags = ("--no-warmup", "--device", "cpu", "--max-batch-run-s", "1")
    with (
        start_server(repository, tmp_path / "server.log", *flags) as server,
        grpc.insecure_channel(server.target) as channel,
    ):
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        model_watch = health.Watch(health_pb2.HealthCheckRequest(service="clip"), timeout=WAIT_S)
        server_watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=WAIT_S)
        try:
            assert next(model_watch).status == health_pb2.HealthCheckResponse.SERVING
            assert next(server_watch).status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as stuck:
                stub.ModelInfer(image_request("clip", (255, 255, 255)), timeout=WAIT_S)
            assert stuck.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "did not finish this request's batch within 1 s" in stuck.value.details()
            # The model, and the server, said they were out of service when the watchdog fired, back when it returned.
            assert next(model_watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert next(server_watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert next(model_watch).status == health_pb2.HealthCheckResponse.SERVING
            assert next(server_watch).status == health_pb2.HealthCheckResponse.SERVING
        finally:
            model_watch.cancel()
            server_watch.cancel()
        again = stub.ModelInfer(image_request("clip", (0, 0, 0)), timeout=20)
        assert again.outputs[0].shape == [1, PROJECTION]
    assert server.process.returncode == 0
