"""SIGTERM with requests in flight: health goes NOT_SERVING, new requests are refused, none accepted is lost."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2

from service.proto import grpc_service_pb2 as pb
from service.proto import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import TINY_MODEL
from tests.servers import health_status, start_server, wait_for_queue_depth


def text_request(text: bytes) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=TINY_MODEL, id=text.decode())
    request.inputs.add(name="text", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(struct.pack("<I", len(text)) + text)
    return request


def test_sigterm_drains_every_accepted_request(tiny_repository: Path, tmp_path: Path) -> None:
    # A 3 s batching delay keeps the requests queued while the signal arrives.
    server = start_server(
        tiny_repository, tmp_path / "server.log", "--max-queue-delay-us", "3000000", "--drain-timeout-s", "20"
    )
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        in_flight = [stub.ModelInfer.future(text_request(b"request %d" % i), timeout=30) for i in range(20)]
        wait_for_queue_depth(server, 20)
        server.terminate()
        deadline = time.monotonic() + 5
        while health_status(server.target) == health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, "health never left SERVING"
            time.sleep(0.05)
        try:
            stub.ModelInfer(text_request(b"late"), timeout=5)
            raise AssertionError("a request after SIGTERM was accepted")
        except grpc.RpcError as refused:
            assert refused.code() == grpc.StatusCode.UNAVAILABLE
        answers = [future.result() for future in in_flight]
    assert [a.id for a in answers] == [f"request {i}" for i in range(20)]
    assert all(len(a.raw_output_contents) == 2 for a in answers)
    assert server.process.wait(timeout=30) == 0
    assert "stopped" in server.log()
