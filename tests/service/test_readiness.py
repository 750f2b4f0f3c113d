"""Readiness while a model loads: health NOT_SERVING, ServerReady false, the model LOADING, inference UNAVAILABLE.

Loading is held open by a write lease (fcntl F_SETLEASE) on the model's ONNX files: the kernel
blocks the server's open() of a leased file until the lease is released, and tells the holder
(SIGIO) the moment someone tries. So the test knows the server is loading, observes it for as
long as it needs, then lets it finish. The server has no hook for this; to it, the file is simply
slow to open, as on a slow volume.
"""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import struct
import threading
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from protocol import grpc_service_pb2 as pb
from protocol import grpc_service_pb2_grpc as pb_grpc
from service.core.repository import read_model
from tests.conftest import TINY_MODEL
from tests.servers import RunningServer, health_status, launch_server, metric_samples, metric_value

LOAD_START_TIMEOUT_S = 120
"""Bounds the wait for the server to reach the model file (imports, port binding); not an assertion."""


class Leases:
    """Write leases on files, held while inside: `opened` is set when another process tries to open one.

    Skips the test where this kernel or filesystem grants no leases.
    """

    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths
        self.opened = threading.Event()
        self._descriptors: list[int] = []
        self._previous_handler: signal.Handlers | None = None

    def __enter__(self) -> Leases:
        # A lease break is announced with SIGIO, whose default action ends the process.
        self._previous_handler = signal.signal(signal.SIGIO, lambda *_: self.opened.set())
        try:
            for path in self.paths:
                self._descriptors.append(os.open(path, os.O_RDONLY))
                fcntl.fcntl(self._descriptors[-1], fcntl.F_SETLEASE, fcntl.F_WRLCK)
        except OSError as error:
            self.__exit__()
            if error.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                pytest.skip(f"this kernel or filesystem grants no file leases: {error}")
            raise
        return self

    def release(self) -> None:
        """Give the leases up: a blocked open() proceeds."""
        while self._descriptors:
            os.close(self._descriptors.pop())

    def __exit__(self, *exc_info: object) -> None:
        self.release()
        signal.signal(signal.SIGIO, self._previous_handler)


def wait_until_loading(server: RunningServer, leases: Leases) -> None:
    """Return once the server tries to open a leased model file; fail if it exits first."""
    waited = 0.0
    while not leases.opened.wait(0.5):
        waited += 0.5
        assert server.process.poll() is None, f"server exited with {server.process.returncode}:\n{server.log()}"
        assert waited < LOAD_START_TIMEOUT_S, f"the server never opened the model file:\n{server.log()}"


def text_request(text: bytes) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=TINY_MODEL)
    request.inputs.add(name="text", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(struct.pack("<I", len(text)) + text)
    return request


def readiness(server: RunningServer) -> dict[str, object]:
    """Everything a client or probe can ask about readiness, answered by the server itself."""
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        try:
            stub.ModelInfer(text_request(b"are you there"), timeout=30)
            inference = "OK"
        except grpc.RpcError as error:
            inference = f"{error.code().name}: {error.details()}"
        index = stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=10)
        return {
            "health": health_status(server.target, timeout_s=10),
            "model health": health_status(server.target, TINY_MODEL, timeout_s=10),
            "live": stub.ServerLive(pb.ServerLiveRequest(), timeout=10).live,
            "ready": stub.ServerReady(pb.ServerReadyRequest(), timeout=10).ready,
            "model ready": stub.ModelReady(pb.ModelReadyRequest(name=TINY_MODEL), timeout=10).ready,
            "index": [(model.name, model.state) for model in index.models],
            "inference": inference,
            "model_ready metric": metric_value(
                metric_samples(server), "encoder_model_ready", model=TINY_MODEL, version="1"
            ),
        }


def test_not_ready_while_the_model_loads_then_ready(repository_copy: Path, tmp_path: Path) -> None:
    model_files = sorted(set(read_model(repository_copy / TINY_MODEL).variants.values()))
    with Leases(model_files) as leases:
        server = launch_server(repository_copy, tmp_path / "server.log")
        try:
            wait_until_loading(server, leases)
            loading = readiness(server)
            leases.release()
            server.wait_until_serving()
            loaded = readiness(server)
        finally:
            leases.release()
            exit_status = server.stop()
    assert loading == {
        "health": health_pb2.HealthCheckResponse.NOT_SERVING,
        "model health": health_pb2.HealthCheckResponse.NOT_SERVING,
        "live": True,
        "ready": False,
        "model ready": False,
        "index": [(TINY_MODEL, "LOADING")],
        "inference": f"UNAVAILABLE: model {TINY_MODEL} is loading",
        "model_ready metric": 0.0,
    }
    assert loaded == {
        "health": health_pb2.HealthCheckResponse.SERVING,
        "model health": health_pb2.HealthCheckResponse.SERVING,
        "live": True,
        "ready": True,
        "model ready": True,
        "index": [(TINY_MODEL, "READY")],
        "inference": "OK",
        "model_ready metric": 1.0,
    }
    assert exit_status == 0
