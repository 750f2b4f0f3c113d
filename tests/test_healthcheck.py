"""The container health probe against a real gRPC health server on a loopback ephemeral port."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from service.ops import healthcheck

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL = "all-MiniLM-L6-v2"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class _StallingHealth(health_pb2_grpc.HealthServicer):
    """A health service that answers only once released: a server that accepted but hangs."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def Check(self, request, context):
        self.release.wait(timeout=10)
        return health_pb2.HealthCheckResponse(status=SERVING)


def _start(servicer: health_pb2_grpc.HealthServicer) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
def health_server() -> Iterator[tuple[health.HealthServicer, str]]:
    servicer = health.HealthServicer()
    server, target = _start(servicer)
    yield servicer, target
    server.stop(grace=None)


def test_serving_overall_exits_zero(health_server, capsys) -> None:
    servicer, target = health_server
    servicer.set("", SERVING)
    assert healthcheck.main(["--target", target]) == 0
    assert capsys.readouterr().err == ""


def test_serving_model_exits_zero(health_server) -> None:
    servicer, target = health_server
    servicer.set(MODEL, SERVING)
    assert healthcheck.main(["--target", target, "--service", MODEL]) == 0


def test_not_serving_exits_one_with_reason(health_server, capsys) -> None:
    servicer, target = health_server
    servicer.set("", NOT_SERVING)
    assert healthcheck.main(["--target", target]) == 1
    err = capsys.readouterr().err
    assert err.startswith("not serving:")
    assert "NOT_SERVING" in err
    assert err.count("\n") == 1


def test_model_not_serving_while_server_serves(health_server) -> None:
    servicer, target = health_server
    servicer.set("", SERVING)
    servicer.set(MODEL, NOT_SERVING)
    assert healthcheck.main(["--target", target]) == 0
    assert healthcheck.main(["--target", target, "--service", MODEL]) == 1


def test_unknown_service_exits_one(health_server, capsys) -> None:
    _, target = health_server
    assert healthcheck.main(["--target", target, "--service", "no-such-model"]) == 1
    assert "no-such-model" in capsys.readouterr().err


def test_nothing_listening_exits_one_as_unreachable(capsys) -> None:
    # A bound but non-listening socket: connections are refused and no other process can take the port.
    # "unreachable" (not "timeout") shows the refusal ended the check rather than the 30 s deadline.
    with socket.socket() as reserved:
        reserved.bind(("127.0.0.1", 0))
        target = f"127.0.0.1:{reserved.getsockname()[1]}"
        assert healthcheck.main(["--target", target, "--timeout-s", "30"]) == 1
    assert capsys.readouterr().err.startswith("unreachable:")


def test_hanging_server_times_out(capsys) -> None:
    servicer = _StallingHealth()
    server, target = _start(servicer)
    try:
        assert healthcheck.main(["--target", target, "--timeout-s", "0.3"]) == 1
    finally:
        servicer.release.set()
        server.stop(grace=None)
    assert capsys.readouterr().err.startswith("timeout:")


@pytest.mark.parametrize("timeout", ["0", "-1", "soon"])
def test_rejects_bad_timeout(timeout) -> None:
    with pytest.raises(SystemExit) as exit_info:
        healthcheck.main(["--timeout-s", timeout])
    assert exit_info.value.code == 2


def test_module_entry_point(health_server) -> None:
    """``python -m service.ops.healthcheck`` as the Docker HEALTHCHECK runs it."""
    servicer, target = health_server
    command = [sys.executable, "-m", "service.ops.healthcheck", "--target", target]
    serving = subprocess.run(command, check=False, cwd=REPO_ROOT, capture_output=True, timeout=30)
    assert serving.returncode == 0
    servicer.set("", NOT_SERVING)
    result = subprocess.run(command, check=False, cwd=REPO_ROOT, capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    assert result.stderr.startswith("not serving:")


@pytest.mark.parametrize(
    ("environ", "target"),
    [
        ({}, "127.0.0.1:8001"),
        ({"ENCODER_GRPC_PORT": "9001"}, "127.0.0.1:9001"),
        ({"ENCODER_GRPC_PORT": "9001", "ENCODER_HEALTH_PORT": "8003"}, "127.0.0.1:8003"),
        ({"ENCODER_HEALTH_PORT": "0"}, "127.0.0.1:8001"),
    ],
)
def test_the_default_target_follows_the_containers_health_port(environ: dict[str, str], target: str) -> None:
    # The image's HEALTHCHECK has no arguments: with TLS on the gRPC port it must ask the plaintext health port.
    assert healthcheck.default_target(environ) == target
