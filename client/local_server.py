"""A server process on this machine: `python -m service` on free loopback ports, for benchmarks and tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

START_TIMEOUT_S = 180


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def health_status(target: str, service: str = "", timeout_s: float = 2.0) -> int | None:
    """The health service's status for a service, or None when unreachable."""
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s).status
        except grpc.RpcError:
            return None


@dataclass
class RunningServer:
    """A server process and where to reach it."""

    process: subprocess.Popen
    grpc_port: int
    metrics_port: int
    log_path: Path

    @property
    def target(self) -> str:
        """host:port of the gRPC service."""
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        """The /metrics endpoint."""
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def log(self) -> str:
        """Everything the server wrote so far."""
        return self.log_path.read_text(errors="replace")

    def terminate(self) -> None:
        """Send SIGTERM (the server drains)."""
        self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 30) -> int:
        """SIGTERM and wait; kill if it does not exit in time. Returns the exit status."""
        if self.process.poll() is None:
            self.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_server(repository: Path, log_path: Path, *arguments: str, env: dict[str, str] | None = None) -> RunningServer:
    """Start `python -m service` on free loopback ports and wait until health reports SERVING."""
    grpc_port, metrics_port = free_port(), free_port()
    command = [
        sys.executable, "-m", "service",
        "--model-repository", str(repository),
        "--host", "127.0.0.1",
        "--grpc-port", str(grpc_port),
        "--metrics-port", str(metrics_port),
        *arguments,
    ]  # fmt: skip
    with log_path.open("w") as log_file:
        process = subprocess.Popen(
            command, stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    server = RunningServer(process, grpc_port, metrics_port, log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{server.log()}")
        if health_status(server.target, timeout_s=1.0) == health_pb2.HealthCheckResponse.SERVING:
            return server
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"server not SERVING after {START_TIMEOUT_S} s:\n{server.log()}")
