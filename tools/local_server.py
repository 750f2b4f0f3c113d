"""A server process on this machine: `python -m service` on free loopback ports, for benchmarks and tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from service.launch.processes import children

START_TIMEOUT_S = 180
BATCH_ROWS, BATCHES_RUN = "encoder_batch_size_sum", "encoder_batch_size_count"
ANSWERED = "encoder_requests_total"


def rows_per_run(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    """Rows per model run between two `RunningServer.batch_totals` readings; None if no batch ran."""
    runs = after[1] - before[1]
    return (after[0] - before[0]) / runs if runs else None


def process_cpu_seconds(pid: int, thread: int | None = None) -> float:
    """User + system CPU seconds a process has used, every thread, as the kernel counts them (/proc).

    `thread`: one thread's seconds only (its id; the process's id is its main thread). OSError
    when the process is gone.
    """
    text = Path(f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat").read_text()
    # The command name (field 2) may hold spaces: count fields from after its closing parenthesis.
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_cpu_seconds(pid: int) -> float:
    """process_cpu_seconds of a server and of its child processes (a server of several: engine, front ends)."""
    return sum(process_cpu_seconds(process) for process in (pid, *children(pid)))


_PORTS_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, never one this process was handed before.

    The kernel may give a just-closed port again at once, so two calls in a row (the gRPC and the
    HTTP port of one server) could otherwise return the same number.
    """
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port not in _PORTS_HANDED_OUT:
            _PORTS_HANDED_OUT.add(port)
            return port


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
    health_target: str = ""
    """host:port answering grpc.health.v1 in plaintext: the gRPC port, or --health-port when TLS is on."""
    http_port: int = 0
    """The HTTP port (OpenAI API, KServe v2 REST)."""

    def __post_init__(self) -> None:
        self.health_target = self.health_target or self.target

    @property
    def target(self) -> str:
        """host:port of the gRPC service."""
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        """Base URL of the HTTP port, as plaintext (a server with --tls-cert answers https:// there)."""
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        """The /metrics endpoint."""
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def _samples(self, model: str) -> Iterator[Sample]:
        """The model's samples on /metrics now (every version)."""
        text = urllib.request.urlopen(self.metrics_url, timeout=5).read().decode()
        for family in text_string_to_metric_families(text):
            yield from (sample for sample in family.samples if sample.labels.get("model") == model)

    def batch_totals(self, model: str) -> tuple[float, float]:
        """(rows, batches) the model has run so far, every version, from /metrics (encoder_batch_size)."""
        totals = {BATCH_ROWS: 0.0, BATCHES_RUN: 0.0}
        for sample in self._samples(model):
            if sample.name in totals:
                totals[sample.name] += sample.value
        return totals[BATCH_ROWS], totals[BATCHES_RUN]

    def answered(self, model: str) -> dict[str, float]:
        """Requests for the model answered so far, by status code (encoder_requests_total), from /metrics."""
        codes: dict[str, float] = {}
        for sample in self._samples(model):
            if sample.name == ANSWERED:
                codes[sample.labels["code"]] = codes.get(sample.labels["code"], 0.0) + sample.value
        return codes

    def log(self) -> str:
        """Everything the server wrote so far."""
        return self.log_path.read_text(errors="replace")

    def terminate(self) -> None:
        """Send SIGTERM (the server drains)."""
        self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 30) -> int:
        """SIGTERM and wait; kill its whole process group if it does not exit in time. Returns the exit status.

        The group is killed in any case once the server is gone, so nothing it started outlives it.
        """
        try:
            if self.process.poll() is None:
                self.terminate()
                self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._kill_group()
            self.process.wait()
        finally:
            self._kill_group()
        return self.process.returncode

    def _kill_group(self) -> None:
        # The server leads its own process group (see launch_server); its pgid is its pid.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)

    def wait_until_serving(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Block until health reports SERVING; RuntimeError (server stopped) if it exits or times out first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.stop()
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()}")
            if health_status(self.health_target, timeout_s=1.0) == health_pb2.HealthCheckResponse.SERVING:
                return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not SERVING after {timeout_s} s:\n{self.log()}")

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def start_server(
    repository: Path,
    log_path: Path,
    *arguments: str,
    env: dict[str, str] | None = None,
    health_target: str = "",
) -> RunningServer:
    """Start `python -m service` on free loopback ports and wait until health reports SERVING.

    `health_target`: where to ask for health when the gRPC port speaks TLS (its --health-port).
    Whatever interrupts the wait (a failed start, a timeout, Ctrl-C), the server is stopped.
    """
    server = launch_server(repository, log_path, *arguments, env=env, health_target=health_target)
    try:
        server.wait_until_serving()
    except BaseException:
        server.stop()
        raise
    return server


def launch_server(
    repository: Path,
    log_path: Path,
    *arguments: str,
    env: dict[str, str] | None = None,
    health_target: str = "",
) -> RunningServer:
    """Start `python -m service` on free loopback ports in its own process group, without waiting for it."""
    grpc_port, metrics_port, http_port = free_port(), free_port(), free_port()
    command = [
        sys.executable, "-m", "service",
        "--model-repository", str(repository),
        "--host", "127.0.0.1",
        "--grpc-port", str(grpc_port),
        "--metrics-port", str(metrics_port),
        "--http-port", str(http_port),
        *arguments,
    ]  # fmt: skip
    with log_path.open("w") as log_file:
        process = subprocess.Popen(
            command,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    return RunningServer(process, grpc_port, metrics_port, log_path, health_target, http_port)
