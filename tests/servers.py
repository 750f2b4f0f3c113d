"""Real servers for the tests (see tools.local_server), and whether a GPU is usable here."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper
from prometheus_client.parser import text_string_to_metric_families

from service.core.runtime import cuda_unavailable_reason
from service.launch.envoy import chosen_transport
from service.launch.processes import children
from tools.local_server import RunningServer, free_port, health_status
from tools.local_server import launch_server as launch_local_server
from tools.local_server import start_server as start_local_server

__all__ = [
    "GRPC_TRANSPORT",
    "ROOT",
    "RunningServer",
    "cuda_usable",
    "free_port",
    "health_status",
    "launch_server",
    "metric_samples",
    "metric_value",
    "post_json",
    "server_pids",
    "start_server",
    "wait_for_metric",
    "wait_for_queue_depth",
    "wait_until",
]

ROOT = Path(__file__).resolve().parent.parent
GRPC_TRANSPORT, _ = chosen_transport(os.environ.get("ENCODER_GRPC_TRANSPORT", "auto"))
"""The transport the suite's servers serve gRPC with (the gRPC suites run again on grpcio: see the Makefile)."""


def server_pids(server: RunningServer) -> list[int]:
    """The server's processes: the one started, and (a server of several) the engine and the front ends."""
    return [server.process.pid, *children(server.process.pid)]


def failed_start(repository: Path, *arguments: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """Run a server on loopback ports that is expected to stop at start; its exit status and output."""
    command = [
        sys.executable, "-m", "service",
        "--model-repository", str(repository),
        "--host", "127.0.0.1",
        "--grpc-port", str(free_port()),
        "--metrics-port", str(free_port()),
        *arguments,
    ]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)


def start_server(
    repository: Path, log_path: Path, *arguments: str, env: dict[str, str] | None = None, health_target: str = ""
) -> RunningServer:
    """A server for tests: one ONNX Runtime thread, so several can share this machine's cores."""
    return start_local_server(
        repository, log_path, "--intra-op-threads", "1", *arguments, env=env, health_target=health_target
    )


def launch_server(repository: Path, log_path: Path, *arguments: str) -> RunningServer:
    """As start_server, without waiting for SERVING (for tests that watch a server start)."""
    return launch_local_server(repository, log_path, "--intra-op-threads", "1", *arguments)


@functools.cache
def cuda_usable() -> bool:
    """Whether ONNX Runtime can create a session on the CUDA execution provider here."""
    if cuda_unavailable_reason() is not None:  # known without a session (and without ORT's own error log)
        return False
    node = helper.make_node("Identity", ["x"], ["y"])
    graph = helper.make_graph(
        [node],
        "probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    options = ort.SessionOptions()
    options.log_severity_level = 4
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CUDAExecutionProvider", "CPUExecutionProvider"]
    )
    session.run(None, {"x": np.zeros(1, dtype=np.float32)})
    return session.get_providers()[0] == "CUDAExecutionProvider"


MetricSamples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def metric_samples(server: RunningServer) -> MetricSamples:
    """Every sample on /metrics, keyed by (name, sorted label items), parsed by prometheus_client."""
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def metric_value(samples: MetricSamples, name: str, **labels: str) -> float:
    """One sample's value (0 when absent: counters and gauges start there)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    """Ask `condition` until it holds: how a test waits for something the server does in its own time.

    The timeout only bounds a wait for something that should happen; it is never what a test asserts.
    """
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never {what} within {timeout_s} s"
        time.sleep(0.05)


def wait_for_metric(server: RunningServer, name: str, value: float, timeout_s: float = 30, **labels: str) -> None:
    """Poll /metrics until a sample holds `value`: the way a test learns what the server did, without sleeping blind.

    The timeout only bounds a wait for something that should happen; it is never what a test asserts.
    """
    deadline = time.monotonic() + timeout_s
    seen = None
    while time.monotonic() < deadline:
        seen = metric_value(metric_samples(server), name, **labels)
        if seen == value:
            return
        time.sleep(0.02)
    raise AssertionError(f"{name}{labels} is {seen}, never {value} within {timeout_s} s")


def wait_for_queue_depth(server: RunningServer, depth: int, model: str, version: str = "1") -> None:
    """Wait until a model's batching queue holds `depth` requests (so a test knows they arrived)."""
    wait_for_metric(server, "encoder_queue_depth", depth, model=model, version=version)


def post_json(
    server: RunningServer, route: str, body: object, headers: dict[str, str] | None = None
) -> tuple[int, object]:
    """POST JSON (or raw bytes) to a server's HTTP port (with `headers`, e.g. a key): the status and the answer."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        server.http_url + route,
        data=data,
        headers={"content-type": "application/json", **(headers or {})},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())
