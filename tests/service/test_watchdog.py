"""The stuck-run watchdog, end to end: a run past --max-batch-run-s fails its request, takes the model out of
service (NOT_SERVING) until the run returns, and then the model serves again.

The model here is a real ONNX graph that takes seconds for one input and microseconds for others:
a Loop of millions of empty turns when the first token id is 29999.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from protocol import grpc_service_pb2_grpc as pb_grpc
from service.core.repository import FIDELITY_FILE
from tests.conftest import TINY_MODEL
from tests.onnx_graphs import SLOW_ID, slow_on_demand_model, token_request
from tests.servers import health_status, start_server

WAIT_S = 120
"""Bounds the wait for the slow run to return; a server that hangs fails the test instead of blocking it."""


def wait_for_health(target: str, status: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while health_status(target, TINY_MODEL) != status:
        assert time.monotonic() < deadline, f"model health never became {status}"
        time.sleep(0.1)


def test_a_run_past_the_limit_fails_its_request_and_takes_the_model_out_until_it_returns(
    repository_copy: Path, tmp_path: Path
) -> None:
    slow_on_demand_model(repository_copy / TINY_MODEL / "1" / "model.onnx")
    (repository_copy / TINY_MODEL / FIDELITY_FILE).unlink(missing_ok=True)  # references of the real model
    flags = ("--no-warmup", "--device", "cpu", "--max-batch-run-s", "1")
    with (
        start_server(repository_copy, tmp_path / "server.log", *flags) as server,
        grpc.insecure_channel(server.target) as channel,
    ):
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        fast = stub.ModelInfer(token_request(TINY_MODEL, [101, 5, 102]), timeout=20)
        assert np.frombuffer(fast.raw_output_contents[0], "<f4")[0] == 101 + 5 + 102
        with pytest.raises(grpc.RpcError) as stuck:
            stub.ModelInfer(token_request(TINY_MODEL, [SLOW_ID, 5]), timeout=WAIT_S)
        assert stuck.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "did not finish this request's batch within 1 s" in stuck.value.details()
        # Its only instance is still running that batch: the model is out of service, and says so.
        assert health_status(server.target, TINY_MODEL) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelInfer(token_request(TINY_MODEL, [101, 6, 102]), timeout=20)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no model instance is in service" in refused.value.details()
        # The run returns at last: the instance, the model and the server serve again.
        wait_for_health(server.target, health_pb2.HealthCheckResponse.SERVING)
        again = stub.ModelInfer(token_request(TINY_MODEL, [101, 7, 102]), timeout=20)
        assert np.frombuffer(again.raw_output_contents[0], "<f4")[0] == 101 + 7 + 102
    assert server.process.returncode == 0
