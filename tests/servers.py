"""Real servers for the tests (see client.local_server), and whether a GPU is usable here."""

from __future__ import annotations

import functools
import time
import urllib.request
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper
from prometheus_client.parser import text_string_to_metric_families

from client.local_server import RunningServer, free_port, health_status
from client.local_server import start_server as start_local_server

__all__ = [
    "ROOT",
    "RunningServer",
    "cuda_usable",
    "free_port",
    "health_status",
    "start_server",
    "wait_for_queue_depth",
]

ROOT = Path(__file__).resolve().parent.parent


def start_server(repository: Path, log_path: Path, *arguments: str, env: dict[str, str] | None = None) -> RunningServer:
    """A server for tests: one ONNX Runtime thread, so several can share this machine's cores."""
    return start_local_server(repository, log_path, "--intra-op-threads", "1", *arguments, env=env)


@functools.cache
def cuda_usable() -> bool:
    """Whether ONNX Runtime can create a session on the CUDA execution provider here."""
    if "CUDAExecutionProvider" not in ort.get_available_providers():
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


def wait_for_queue_depth(server: RunningServer, depth: int, timeout_s: float = 10) -> None:
    """Poll /metrics until a model's batching queue holds `depth` requests (so a test knows they arrived)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
        for family in text_string_to_metric_families(text):
            if family.name == "encoder_queue_depth" and any(sample.value == depth for sample in family.samples):
                return
        time.sleep(0.05)
    raise AssertionError(f"queue never reached {depth} requests")
