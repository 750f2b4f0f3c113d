"""SIGTERM with work accepted: health goes NOT_SERVING, the ports stop taking requests, and every request
accepted before the signal is answered OK, over gRPC and HTTP; health Watches see NOT_SERVING, then end,
without holding the drain.

The requests are held in the queue by a batching delay of 600 s, far past the test, so the drain
starts with all of them accepted and waiting whatever this machine's speed; a drain runs them at
once instead of waiting out the delay. The model is a real ONNX graph that runs for seconds when a
batch leads with one input (tests.onnx_graphs), so the drain lasts long enough to be looked at.
"""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protocol import grpc_service_pb2_grpc as pb_grpc
from service.core.repository import FIDELITY_FILE
from tests.conftest import TINY_MODEL
from tests.onnx_graphs import SLOW_ID, slow_on_demand_model, token_request
from tests.servers import free_port, health_status, metric_samples, metric_value, start_server, wait_for_metric

HELD = 20
SLOW_TURNS = 20_000_000
"""The slow request's Loop turns: many seconds of ONNX Runtime's time, for the drain to start behind it."""
EXIT_TIMEOUT_S = 120
"""Bounds the wait for an exit that should come; a server that hangs fails the test instead of blocking it."""


def refuses_connections(port: int) -> bool:
    """Whether nothing listens on the loopback port any more."""
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


def kserve_tokens(ids: list[int]) -> bytes:
    inputs = [
        {"name": name, "datatype": "INT64", "shape": [1, len(ids)], "data": values}
        for name, values in (("input_ids", ids), ("attention_mask", [1] * len(ids)))
    ]
    return json.dumps({"inputs": inputs, "outputs": [{"name": "embedding"}]}).encode()


def http_infer(url: str, ids: list[int]) -> list[float]:
    request = urllib.request.Request(url, kserve_tokens(ids), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=EXIT_TIMEOUT_S) as answer:
        return json.loads(answer.read())["outputs"][0]["data"]


def test_sigterm_answers_every_accepted_request_then_exits_cleanly(repository_copy: Path, tmp_path: Path) -> None:
    slow_on_demand_model(repository_copy / TINY_MODEL / "1" / "model.onnx", SLOW_TURNS)
    (repository_copy / TINY_MODEL / FIDELITY_FILE).unlink(missing_ok=True)  # references of the real model
    health_port = free_port()
    flags = (
        "--no-warmup", "--device", "cpu", "--max-queue-delay-us", "600000000",
        "--drain-timeout-s", "300", "--health-port", str(health_port),
    )  # fmt: skip
    server = start_server(repository_copy, tmp_path / "server.log", *flags, health_target=f"127.0.0.1:{health_port}")
    with (
        server,
        grpc.insecure_channel(server.target) as channel,
        ThreadPoolExecutor(1) as http_client,
    ):
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=EXIT_TIMEOUT_S
        )
        try:
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            assert os.getpgid(server.process.pid) == server.process.pid  # its own process group, killed on stop
            slow = stub.ModelInfer.future(token_request(TINY_MODEL, [SLOW_ID, 5]), timeout=EXIT_TIMEOUT_S)
            wait_for_metric(server, "encoder_queue_depth", 1, model=TINY_MODEL, version="1")  # it leads the batch
            accepted = [
                stub.ModelInfer.future(token_request(TINY_MODEL, [101, i]), timeout=EXIT_TIMEOUT_S) for i in range(HELD)
            ]
            over_http = http_client.submit(http_infer, f"{server.http_url}/v2/models/{TINY_MODEL}/infer", [7, 8, 9])
            wait_for_metric(server, "encoder_queue_depth", HELD + 2, model=TINY_MODEL, version="1")

            server.terminate()
            # The server announces NOT_SERVING itself, on the stream it holds open: an unreachable
            # server would end the stream with an error instead.
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert not slow.done() and not over_http.done()
            assert not [future for future in accepted if future.done()], "answered before the drain began"
        finally:
            watch.cancel()

        # Draining: the inference ports take no new requests (gRPC's GOAWAY, then the listeners close);
        # the plaintext health port says NOT_SERVING; the accepted work runs (the slow batch).
        deadline = time.monotonic() + EXIT_TIMEOUT_S
        while not (refuses_connections(server.grpc_port) and refuses_connections(server.http_port)):
            assert time.monotonic() < deadline, "the ports kept accepting connections while draining"
            time.sleep(0.02)
        with grpc.insecure_channel(server.target) as late_channel, pytest.raises(grpc.RpcError) as refused:
            pb_grpc.GRPCInferenceServiceStub(late_channel).ModelInfer(token_request(TINY_MODEL, [1, 2]), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert health_status(server.health_target) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert metric_value(metric_samples(server), "encoder_inflight_requests", model=TINY_MODEL, version="1") >= 1

        # Every request accepted before the signal is answered, and right.
        assert np.frombuffer(slow.result().raw_output_contents[0], "<f4")[0] == SLOW_ID + 5
        for index, future in enumerate(accepted):
            assert np.frombuffer(future.result().raw_output_contents[0], "<f4")[0] == 101 + index
        assert over_http.result()[0] == 7 + 8 + 9
        assert server.process.wait(timeout=EXIT_TIMEOUT_S) == 0
    assert "stopped" in server.log()


def test_open_health_watches_see_not_serving_then_end_without_holding_the_drain(
    tiny_repository: Path, tmp_path: Path
) -> None:
    # A grace period far past EXIT_TIMEOUT_S: a Watch that held the stop would fail the test.
    with (
        start_server(tiny_repository, tmp_path / "server.log", "--drain-timeout-s", "300") as server,
        grpc.insecure_channel(server.target) as channel,
    ):
        health = health_pb2_grpc.HealthStub(channel)
        watches = {
            service: health.Watch(health_pb2.HealthCheckRequest(service=service), timeout=EXIT_TIMEOUT_S)
            for service in ("", TINY_MODEL, "no-such-service")
        }
        assert [next(watch).status for watch in watches.values()] == [
            health_pb2.HealthCheckResponse.SERVING,
            health_pb2.HealthCheckResponse.SERVING,
            health_pb2.HealthCheckResponse.SERVICE_UNKNOWN,
        ]

        server.terminate()

        for service, watch in watches.items():
            if service != "no-such-service":  # its status never changes: it only sees the end
                assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as ended:
                next(watch)
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
            assert ended.value.details() == "the server is shutting down"
        assert server.process.wait(timeout=EXIT_TIMEOUT_S) == 0
    assert "stopped" in server.log()
