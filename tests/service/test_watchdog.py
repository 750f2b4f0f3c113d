"""The stuck-run watchdog, end to end: a run past --max-batch-run-s fails its request, takes the model out of
service (NOT_SERVING) until the run returns, and then the model serves again.

The model here is a real ONNX graph that takes seconds for one input and microseconds for others:
a Loop of millions of empty turns when the first token id is 29999.
"""

from __future__ import annotations

import struct
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2
from onnx import TensorProto, helper

from service.proto import grpc_service_pb2 as pb
from service.proto import grpc_service_pb2_grpc as pb_grpc
from service.repository import FIDELITY_FILE
from tests.conftest import TINY_MODEL
from tests.onnx_graphs import WIDTH, constant, save_token_graph
from tests.servers import health_status, start_server

SLOW_ID = 29999
TURNS = 4_000_000
"""Loop turns of the slow input: seconds of ONNX Runtime's time, far past the 1 s limit below."""
WAIT_S = 120
"""Bounds the wait for the slow run to return; a server that hangs fails the test instead of blocking it."""


def _slow_on_demand_model(path: Path) -> None:
    """embedding[b] = sum of row b's ids (x32); a Loop whose trip count is TURNS when ids[0][0] == SLOW_ID."""
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["condition_in"], ["condition_out"]),
            helper.make_node("Identity", ["carried_in"], ["carried_out"]),
        ],
        "turn",
        [
            helper.make_tensor_value_info("turn", TensorProto.INT64, []),
            helper.make_tensor_value_info("condition_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("carried_in", TensorProto.FLOAT, [1]),
        ],
        [
            helper.make_tensor_value_info("condition_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("carried_out", TensorProto.FLOAT, [1]),
        ],
    )
    nodes = [
        # Trip count: TURNS if the first id is SLOW_ID, else 0.
        constant("first", [0]),
        helper.make_node("Flatten", ["input_ids"], ["flat"], axis=0),
        helper.make_node("Gather", ["flat", "first"], ["first_id"], axis=1),
        constant("slow_id", [SLOW_ID]),
        helper.make_node("Equal", ["first_id", "slow_id"], ["is_slow"]),
        helper.make_node("Cast", ["is_slow"], ["is_slow_count"], to=TensorProto.INT64),
        constant("turns", [TURNS]),
        helper.make_node("Mul", ["is_slow_count", "turns"], ["trip_vector"]),
        constant("scalar", []),
        helper.make_node("Reshape", ["trip_vector", "scalar"], ["trip"]),
        helper.make_node("Constant", [], ["keep_going"], value=helper.make_tensor("t", TensorProto.BOOL, [], [True])),
        constant("zero", [0], TensorProto.FLOAT),
        helper.make_node("Loop", ["trip", "keep_going", "zero"], ["carried"], body=body),
        constant("row_axes", [1]),
        helper.make_node("ReduceSum", ["ids", "row_axes"], ["row_sums"], keepdims=1),
        helper.make_node("Add", ["row_sums", "carried"], ["row_sums_kept"]),  # keeps the Loop in the graph
        constant("widths", [1, WIDTH]),
        helper.make_node("Tile", ["row_sums_kept", "widths"], ["embedding"]),
    ]
    save_token_graph(path, "slow_on_demand", nodes)


def token_request(ids: list[int]) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=TINY_MODEL)
    for name, values in (("input_ids", ids), ("attention_mask", [1] * len(ids))):
        request.inputs.add(name=name, datatype="INT64", shape=[1, len(ids)])
        request.raw_input_contents.append(struct.pack(f"<{len(ids)}q", *values))
    request.outputs.add(name="embedding")
    return request


def wait_for_health(target: str, status: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while health_status(target, TINY_MODEL) != status:
        assert time.monotonic() < deadline, f"model health never became {status}"
        time.sleep(0.1)


def test_a_run_past_the_limit_fails_its_request_and_takes_the_model_out_until_it_returns(
    repository_copy: Path, tmp_path: Path
) -> None:
    _slow_on_demand_model(repository_copy / TINY_MODEL / "1" / "model.onnx")
    (repository_copy / TINY_MODEL / FIDELITY_FILE).unlink(missing_ok=True)  # references of the real model
    flags = ("--no-warmup", "--device", "cpu", "--max-batch-run-s", "1")
    with (
        start_server(repository_copy, tmp_path / "server.log", *flags) as server,
        grpc.insecure_channel(server.target) as channel,
    ):
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        fast = stub.ModelInfer(token_request([101, 5, 102]), timeout=20)
        assert np.frombuffer(fast.raw_output_contents[0], "<f4")[0] == 101 + 5 + 102
        with pytest.raises(grpc.RpcError) as stuck:
            stub.ModelInfer(token_request([SLOW_ID, 5]), timeout=WAIT_S)
        assert stuck.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "did not finish this request's batch within 1 s" in stuck.value.details()
        # Its only instance is still running that batch: the model is out of service, and says so.
        assert health_status(server.target, TINY_MODEL) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelInfer(token_request([101, 6, 102]), timeout=20)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no model instance is in service" in refused.value.details()
        # The run returns at last: the instance, the model and the server serve again.
        wait_for_health(server.target, health_pb2.HealthCheckResponse.SERVING)
        again = stub.ModelInfer(token_request([101, 7, 102]), timeout=20)
        assert np.frombuffer(again.raw_output_contents[0], "<f4")[0] == 101 + 7 + 102
    assert server.process.returncode == 0
