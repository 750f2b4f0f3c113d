"""The image's runtime, rehearsed without a Docker engine.

As the Dockerfile's venv stage does, `.[server]` alone goes into a fresh virtual environment (no torch,
no export or test extra). The server then runs from it as the runtime stage runs it: that stage's USER,
ENV, ENTRYPOINT and CMD, against a read-only copy of an exported repository, with a read-only working
directory and HOME, and a writable TMPDIR of its own for the pod's /tmp emptyDir
(deploy/base/deployment.yaml). It is driven over gRPC and HTTP and answers as this checkout's server
does. So a missing runtime dependency, an import of torch, or a write to a read-only path is caught
here, where the image cannot be built.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from client import EmbeddingClient
from service.launch.envoy import chosen_transport
from tests.conftest import DEFAULT_MODEL
from tests.deploy.test_dockerfile import DOCKERFILE, Stage, _command, _parse
from tests.installs import copy_project_source, fresh_environment, pip_install
from tests.servers import ROOT, server_pids
from tools.local_server import RunningServer, free_port, health_status

EMBEDDING_DIMENSION = 384
"""all-MiniLM-L6-v2's."""
SENTENCES = ["A man is eating food.", "The image runs as an unprivileged user.", "Read-only everywhere."]
IMAGE_VENV = "/opt/venv"
IMAGE_REPOSITORY = "/models"
SYSTEM_PATH = "/usr/bin:/bin"
"""What `$PATH` in the image's ENV stands for here."""
INSTALLED_MARK = ".installed"
WRITE_FAILURES = ("PermissionError", "Permission denied", "Read-only file system", "Errno 13", "Errno 30", "Traceback")
"""What a server log says when something tried to write where it may not (or failed otherwise)."""
TELEMETRY_WRITE = "Failed to persist telemetry device ID"
"""ONNX Runtime's (1.29+) warning when it cannot create $HOME/.cache for its telemetry (ORT_DISABLE_TELEMETRY=1)."""


def runtime_stage() -> Stage:
    """The Dockerfile's last stage: the image that runs."""
    _, stages = _parse(DOCKERFILE.read_text())
    return stages[-1]


def server_identity(stage: Stage) -> dict[str, object]:
    """subprocess options that run a process as the image's USER (as root), or as this unprivileged user."""
    if os.geteuid() != 0:
        return {}
    uid, _, gid = stage.arguments("USER")[-1].partition(":")
    return {"user": int(uid), "group": int(gid or uid), "extra_groups": []}


def expected_uid(identity: dict[str, object]) -> int:
    """The real and effective UID the server's processes must have."""
    return int(identity.get("user", os.geteuid()))


def interpreter_for(identity: dict[str, object]) -> str:
    """A Python >= 3.10 with venv that the server's user may run (root's pyenv under /root is not one)."""
    probe = "import sys, venv; sys.exit(sys.version_info < (3, 10))"
    candidates = dict.fromkeys([os.path.realpath(sys._base_executable), shutil.which("python3"), "/usr/bin/python3"])
    for candidate in filter(None, candidates):
        try:
            run = subprocess.run([candidate, "-c", probe], check=False, capture_output=True, cwd="/", **identity)
        except PermissionError:  # a folder on its path is closed to that user
            continue
        if run.returncode == 0:
            return candidate
    pytest.fail(f"no Python >= 3.10 with venv that {identity or 'this user'} can run among {list(candidates)}")


@pytest.fixture(scope="session")
def runtime_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The python of a virtual environment holding `.[server]` alone, as the image's /opt/venv.

    Cached under .test-cache/ per pyproject.toml and interpreter: the dependencies are installed once,
    the project itself again each session (so the environment runs this checkout's code).
    """
    interpreter = interpreter_for(server_identity(runtime_stage()))
    key = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + interpreter.encode()).hexdigest()[:16]
    environment = ROOT / ".test-cache" / f"server-venv-{key}"
    source = copy_project_source(tmp_path_factory.mktemp("server-install") / "source")
    python = environment / "bin" / "python"
    if (environment / INSTALLED_MARK).is_file():
        pip_install(python, "--no-deps", "--force-reinstall", str(source))
    else:
        shutil.rmtree(environment, ignore_errors=True)
        fresh_environment(environment, interpreter)
        pip_install(python, f"{source}[server]")
        (environment / INSTALLED_MARK).touch()
    return python


@pytest.fixture(scope="module")
def read_only_tree(default_repository: Path) -> Iterator[Path]:
    """Root-owned (or this user's), mode 0555/0444: `models` (the exported repository), `home`, `workdir`.

    Made with mkdtemp, not tmp_path: pytest's base folder is private to its user (0700).
    """
    tree = Path(tempfile.mkdtemp(prefix="image-runtime-"))
    shutil.copytree(default_repository, tree / "models")
    (tree / "home").mkdir()
    (tree / "workdir").mkdir()
    for path in sorted(tree.rglob("*"), reverse=True):
        path.chmod(0o555 if path.is_dir() else 0o444)
    tree.chmod(0o555)
    yield tree
    for path in [tree, *tree.rglob("*")]:
        if path.is_dir():
            path.chmod(0o755)
    shutil.rmtree(tree)


@dataclass(frozen=True)
class ImageFolders:
    """Where the server runs: the read-only tree, and a writable folder of its user alone (0700), the pod's /tmp."""

    read_only: Path
    scratch: Path


@pytest.fixture
def folders(read_only_tree: Path) -> Iterator[ImageFolders]:
    """The module's read-only tree and a new scratch folder."""
    identity = server_identity(runtime_stage())
    scratch = Path(tempfile.mkdtemp(prefix="image-runtime-tmp-"))
    if identity:
        os.chown(scratch, int(identity["user"]), int(identity["group"]))
    yield ImageFolders(read_only_tree, scratch)
    shutil.rmtree(scratch)


def tree_state(tree: Path) -> dict[str, tuple[int, int, int, int]]:
    """Every path under a folder: its mode, owner, size and modification time."""
    state = {}
    for path in [tree, *tree.rglob("*")]:
        status = path.lstat()
        state[str(path.relative_to(tree))] = (status.st_mode, status.st_uid, status.st_size, status.st_mtime_ns)
    return state


def image_environment(stage: Stage, python: Path, home: Path, scratch: Path, health_port: int) -> dict[str, str]:
    """The runtime stage's ENV, its /opt/venv this environment; nothing inherited from the test's own."""
    environment = {}
    for arguments in stage.arguments("ENV"):
        for word in shlex.split(arguments):
            name, _, value = word.partition("=")
            environment[name] = value
    venv = str(python.parent.parent)
    environment["PATH"] = environment["PATH"].replace(IMAGE_VENV, venv).replace("$PATH", SYSTEM_PATH)
    assert environment["PATH"].startswith(f"{venv}/bin:"), "the image's python is not its venv's"
    assert environment.pop("ENCODER_HEALTH_PORT"), "the image sets no health port"
    return {**environment, "ENCODER_HEALTH_PORT": str(health_port), "HOME": str(home), "TMPDIR": str(scratch)}


def image_command(stage: Stage) -> list[str]:
    """The runtime stage's ENTRYPOINT + CMD."""
    (entrypoint,), (command,) = stage.arguments("ENTRYPOINT"), stage.arguments("CMD")
    return _command(entrypoint) + _command(command)


def healthcheck_command(stage: Stage) -> list[str]:
    """The runtime stage's HEALTHCHECK command."""
    (healthcheck,) = stage.arguments("HEALTHCHECK")
    return _command(healthcheck.split(" CMD ", 1)[1].strip())


def launch_image_server(
    stage: Stage, environment: dict[str, str], tree: Path, identity: dict[str, object], log_path: Path
) -> RunningServer:
    """The image's command from the read-only working directory, on loopback ports, in its own process group."""
    grpc_port, metrics_port, http_port = free_port(), free_port(), free_port()
    command = [tree / "models" if word == IMAGE_REPOSITORY else word for word in image_command(stage)]
    command += [
        "--host", "127.0.0.1",
        "--grpc-port", str(grpc_port),
        "--metrics-port", str(metrics_port),
        "--http-port", str(http_port),
        "--intra-op-threads", "1",
    ]  # fmt: skip
    health_target = f"127.0.0.1:{environment['ENCODER_HEALTH_PORT']}"
    with log_path.open("w") as log_file:
        process = subprocess.Popen(
            command,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=environment,
            cwd=tree / "workdir",
            start_new_session=True,
            **identity,
        )
    return RunningServer(process, grpc_port, metrics_port, log_path, health_target, http_port)


def http_embeddings(server: RunningServer, texts: list[str]) -> np.ndarray:
    """POST /v1/embeddings; the embeddings in input order."""
    body = json.dumps({"model": DEFAULT_MODEL, "input": texts}).encode()
    request = urllib.request.Request(
        f"{server.http_url}/v1/embeddings", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        data = json.loads(answer.read())["data"]
    return np.array([item["embedding"] for item in sorted(data, key=lambda item: item["index"])], dtype=np.float32)


def process_uids(pid: int) -> list[int]:
    """A process's real, effective, saved and filesystem UIDs."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return [int(value) for value in line.split()[1:]]
    raise AssertionError(f"/proc/{pid}/status has no Uid line")


def imported_modules(log: str) -> set[str]:
    """Every module any of the server's processes imported, or tried to (PYTHONPROFILEIMPORTTIME's lines)."""
    return {line.rsplit("|", 1)[1].strip() for line in log.splitlines() if line.startswith("import time:")}


def of_package(modules: set[str], package: str) -> set[str]:
    """The modules of one package among `modules`."""
    return {name for name in modules if name == package or name.startswith(f"{package}.")}


@pytest.mark.parametrize("frontends", [1, 2])
def test_the_image_runtime_serves_as_its_user_from_read_only_paths_without_torch(
    frontends: int,
    runtime_python: Path,
    folders: ImageFolders,
    default_server: RunningServer,
    tmp_path: Path,
) -> None:
    read_only_tree, scratch = folders.read_only, folders.scratch
    stage = runtime_stage()
    identity = server_identity(stage)
    environment = image_environment(stage, runtime_python, read_only_tree / "home", scratch, free_port())
    # Every import attempt of every process (children inherit it) is logged, even one that fails.
    environment |= {"ENCODER_FRONTENDS": str(frontends), "PYTHONPROFILEIMPORTTIME": "1"}
    installed = subprocess.run(
        [runtime_python, "-m", "pip", "list", "--format", "json"], check=True, capture_output=True, text=True
    )
    distributions = {item["name"].lower() for item in json.loads(installed.stdout)}
    # The server extra's ONNX Runtime: the CUDA build on Linux x86_64, as in the image.
    runtime = "onnxruntime-gpu" if (sys.platform, platform.machine()) == ("linux", "x86_64") else "onnxruntime"
    assert {"encoder-serve", runtime} <= distributions
    assert not {"torch", "onnx", "transformers", "pytest"} & distributions, "more than the server extra"
    before = tree_state(read_only_tree)

    server = launch_image_server(stage, environment, read_only_tree, identity, tmp_path / "server.log")
    try:
        server.wait_until_serving()
        pids = server_pids(server)
        # A lone grpcio server is one process; else a supervisor, and the engine and front ends (one Envoy
        # front end: the whole server). The rehearsal runs this Python: auto chooses for it as it does here.
        lone = {"grpcio": 1, "envoy": 2}[chosen_transport("auto")[0]]
        assert len(pids) == (lone if frontends == 1 else 2 + frontends), pids
        for pid in pids:
            assert process_uids(pid) == [expected_uid(identity)] * 4, pid
        if frontends > 1:
            # The engine's socket (and the shared metrics) lie in TMPDIR, not under HOME or the working directory.
            (socket_path,) = scratch.glob("encoder-serve-*/engine.sock")
            assert stat.S_ISSOCK(socket_path.lstat().st_mode)

        assert health_status(server.health_target) == health_pb2.HealthCheckResponse.SERVING
        probe = subprocess.run(
            healthcheck_command(stage),
            check=False,
            capture_output=True,
            text=True,
            env=environment,
            cwd=read_only_tree / "workdir",
            timeout=60,
            **identity,
        )
        assert probe.returncode == 0, probe.stderr
        with urllib.request.urlopen(f"{server.http_url}/v2/health/ready", timeout=10) as ready:
            assert ready.status == 200

        expected = EmbeddingClient(default_server.target, model=DEFAULT_MODEL).embed(SENTENCES)
        over_grpc = EmbeddingClient(server.target, model=DEFAULT_MODEL).embed(SENTENCES)
        over_http = http_embeddings(server, SENTENCES)
        for embeddings in (over_grpc, over_http):
            assert embeddings.shape == (len(SENTENCES), EMBEDDING_DIMENSION)
            np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, atol=1e-5)
            np.testing.assert_allclose(embeddings, expected, atol=1e-5)
    finally:
        exit_status = server.stop()

    log = server.log()
    assert exit_status == 0, log
    assert tree_state(read_only_tree) == before
    assert list(scratch.iterdir()) == [], "the server left files in TMPDIR"
    messages = "\n".join(line for line in log.splitlines() if not line.startswith("import time:"))
    for failure in (*WRITE_FAILURES, TELEMETRY_WRITE):
        assert failure not in messages, messages
    modules = imported_modules(log)
    assert {"service.launch.server", "onnxruntime", "tokenizers"} <= modules, "no import log: nothing below is checked"
    for package in ("torch", "export", "client", "tools"):
        assert not of_package(modules, package), f"the server imported {sorted(of_package(modules, package))}"
