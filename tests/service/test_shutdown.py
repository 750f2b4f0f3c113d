"""SIGTERM with requests queued: health goes NOT_SERVING, new requests are refused, accepted ones are kept;
health Watches see NOT_SERVING, then end, without holding the drain.

The server holds the accepted requests in its queue on purpose (a batching delay of 600 s), so
the drain cannot end before the test has looked at it: nothing here depends on how fast this
machine is. The held requests then leave (their clients cancel them), and the drain ends.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.proto import grpc_service_pb2 as pb
from service.proto import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import TINY_MODEL
from tests.servers import health_status, metric_samples, metric_value, start_server, wait_for_queue_depth

HELD = 20
EXIT_TIMEOUT_S = 60
"""Bounds the wait for an exit that should come; a server that hangs fails the test instead of blocking it."""


def text_request(text: bytes) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=TINY_MODEL, id=text.decode())
    request.inputs.add(name="text", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(struct.pack("<I", len(text)) + text)
    return request


def test_sigterm_reports_not_serving_refuses_new_work_and_keeps_accepted_work(
    tiny_repository: Path, tmp_path: Path
) -> None:
    flags = ("--max-queue-delay-us", "600000000", "--drain-timeout-s", "300", "--triton-metrics")
    with (
        start_server(tiny_repository, tmp_path / "server.log", *flags) as server,
        grpc.insecure_channel(server.target) as channel,
    ):
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=EXIT_TIMEOUT_S
        )
        try:
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            assert os.getpgid(server.process.pid) == server.process.pid  # its own process group, killed on stop
            accepted = [stub.ModelInfer.future(text_request(b"request %d" % i)) for i in range(HELD)]
            wait_for_queue_depth(server, HELD, TINY_MODEL)

            server.terminate()
            # The server announces NOT_SERVING itself, on the stream it holds open: an unreachable
            # server would end the stream with an error instead.
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        finally:
            watch.cancel()

        # Draining, and still answering: new work is refused with the server's own reason.
        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelInfer(text_request(b"late"), timeout=30)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in refused.value.details()
        assert health_status(server.target) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert health_status(server.target, TINY_MODEL) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert not stub.ServerReady(pb.ServerReadyRequest(), timeout=10).ready
        assert not stub.ModelReady(pb.ModelReadyRequest(name=TINY_MODEL), timeout=10).ready

        # The accepted requests are neither answered nor failed: they wait in the queue, and the
        # drain waits for them.
        samples = metric_samples(server)
        assert metric_value(samples, "encoder_queue_depth", model=TINY_MODEL, version="1") == HELD
        assert metric_value(samples, "encoder_inflight_requests", model=TINY_MODEL, version="1") == HELD
        assert metric_value(samples, "nv_inference_pending_request_count", model=TINY_MODEL, version="1") == HELD
        assert not [future for future in accepted if future.done()]
        assert server.process.poll() is None

        # Once they leave, the drain has nothing left to wait for: the server exits, cleanly.
        for future in accepted:
            future.cancel()
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
