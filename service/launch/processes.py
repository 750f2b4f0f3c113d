"""A server of several processes: one supervisor, one engine process, N front-end processes.

    encoder-serve: supervisor      /metrics (every process's figures), signals, the others' lives
     ├─ encoder-serve: engine      the models: batchers and ONNX Runtime sessions, one Unix socket
     ├─ encoder-serve: frontend 1  the gRPC, HTTP and health ports (shared: SO_REUSEPORT), keys, TLS,
     └─ encoder-serve: frontend N  validation, tokenising; rows to the engine, outputs back

With --grpc-transport envoy each front end is an Envoy process running the front end on its embedded
Python (service.launch.envoy); it drains when its standard input closes, as Envoy keeps
SIGTERM for itself, so the supervisor stops it by closing that pipe. With one front end, that Envoy
process runs the whole server, engine included (no socket, no second process):

    encoder-serve: supervisor      /metrics, signals, the server's life
     └─ encoder-serve: server      Envoy: the ports, the front end and the models

The supervisor holds the ports and starts every process at once; each front end binds the ports
(health NOT_SERVING), then connects to the engine, which loads the models once every front end has
connected, as a lone server binds its ports before it loads. A process that
exits on its own is never left to a half-working server: the supervisor stops the others and exits
non-zero (2 if a process could not start, as a lone server exits; 1 otherwise), so Kubernetes
restarts the pod; the children die with the supervisor (PR_SET_PDEATHSIG). On SIGTERM or SIGINT the
front ends drain first (NOT_SERVING, no new requests, accepted ones answered by the engine), then
the engine stops, and the supervisor exits 0 if every process did.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.multiprocess import MultiProcessCollector

from service.launch import envoy
from service.ops.metrics import LiveGauges
from service.ops.settings import Settings
from service.ops.statistics import TABLES, StatisticsTables, TritonMetricsCollector

log = logging.getLogger(__name__)

TITLE = "encoder-serve"
ROLE_VARIABLE = "ENCODER_SERVE_ROLE"
"""Set for a child process: `engine`, `frontend N`, or `server` (Envoy's whole server)."""
RUNTIME_VARIABLE = "ENCODER_SERVE_RUNTIME"
"""Set for a child process: the folder of the engine's socket, the metrics and the statistics."""
SETTINGS_VARIABLE = "ENCODER_SERVE_SETTINGS"
"""Set for a child process: the server's settings, as JSON."""
ENGINE_SOCKET = "engine.sock"
STATISTICS_FOLDER = "statistics"
METRICS_FOLDER = "metrics"
STOP_GRACE_S = 5
"""After a process died: how long the others get to stop before they are killed."""
POLL_S = 0.05
_PR_SET_PDEATHSIG = 1


def frontends(settings: Settings) -> int:
    """How many front ends to run: `--frontends`, or the automatic choice for where the model will run."""
    if settings.frontends:
        return settings.frontends
    on_cuda = False
    if settings.device != "cpu" and settings.variant != "int8":
        # Only to choose: the model is loaded by the engine process, which places it for itself.
        from service.core.runtime import cuda_unavailable_reason  # noqa: PLC0415

        on_cuda = cuda_unavailable_reason(settings.cuda_device_id) is None
    return settings.resolved_frontends(on_cuda)


def roles(settings: Settings) -> list[str]:
    """The children a supervisor starts: the engine and each front end, or (Envoy, one front end) the server."""
    if settings.grpc_transport == "envoy" and settings.frontends == 1:
        return ["server"]
    return ["engine", *(f"frontend {index}" for index in range(1, settings.frontends + 1))]


def envoy_index(role: str) -> int:
    """The Envoy process a role runs in (its admin socket's number): front end N's, or 1 for the whole server."""
    return 1 if role == "server" else int(role.rsplit(maxsplit=1)[-1])


def set_title(role: str) -> None:
    """Name this process's role in `ps` (`encoder-serve: engine`)."""
    import setproctitle  # noqa: PLC0415 - only processes of a server of several are renamed

    setproctitle.setproctitle(f"{TITLE}: {role}")


def configure_logging(settings: Settings, role: str) -> None:
    """Log to stderr at --log-level, each line naming the process's role (but a lone server's)."""
    logging.basicConfig(
        level=settings.log_level,
        format=f"%(asctime)s %(levelname)s {'' if role == 'server' else f'[{role}] '}%(name)s: %(message)s",
        stream=sys.stderr,
    )


def _die_with_parent() -> None:
    """Be killed when the supervisor dies, however it dies (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the supervisor died before the line above
        os._exit(1)


def child_settings() -> tuple[str, Settings, Path] | None:
    """In a child process: its role, the server's settings and the runtime folder; None in the supervisor."""
    role = os.environ.get(ROLE_VARIABLE)
    if role is None:
        return None
    values = json.loads(os.environ[SETTINGS_VARIABLE])
    values["model_repository"] = Path(values["model_repository"])
    return role, Settings(**values), Path(os.environ[RUNTIME_VARIABLE])


def runtime_folder() -> Path:
    """In a child process: the folder of the engine's socket, the metrics and the statistics."""
    return Path(os.environ[RUNTIME_VARIABLE])


def prepare_child(role: str, runtime: Path) -> None:
    """Before anything else in a child: its title, its fate tied to the supervisor's, its statistics shared."""
    _die_with_parent()
    set_title(role)
    TABLES.share_in(runtime / STATISTICS_FOLDER)


def _reserved_port(host: str, port: int) -> socket.socket:
    """A socket bound, not listening, to the port with SO_REUSEPORT: it holds the port the front ends share.

    Port 0 becomes a real port here, the one every front end then binds.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    reserved = socket.socket(family, socket.SOCK_STREAM)
    reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    reserved.bind((host, port))
    return reserved


@dataclasses.dataclass
class _Child:
    role: str
    process: subprocess.Popen

    @property
    def exited(self) -> int | None:
        return self.process.poll()

    def request_stop(self) -> None:
        """Ask the process to drain and exit: SIGTERM, or (an Envoy front end) its standard input closed."""
        if self.process.stdin is not None:
            self.process.stdin.close()
        else:
            self.process.send_signal(signal.SIGTERM)


class Supervisor:
    """Starts the engine and the front ends, serves /metrics, and keeps the server whole or stops it."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.runtime = Path(tempfile.mkdtemp(prefix="encoder-serve-"))
        (self.runtime / METRICS_FOLDER).mkdir()
        (self.runtime / STATISTICS_FOLDER).mkdir()
        self._children: list[_Child] = []
        self._reserved: list[socket.socket] = []
        self._stop_requested = False

    def _spawn(self, role: str, settings: Settings) -> _Child:
        values = {**dataclasses.asdict(settings), "model_repository": str(settings.model_repository)}
        env = {
            **os.environ,
            ROLE_VARIABLE: role,
            RUNTIME_VARIABLE: str(self.runtime),
            SETTINGS_VARIABLE: json.dumps(values),
            "PROMETHEUS_MULTIPROC_DIR": str(self.runtime / METRICS_FOLDER),
        }
        if role != "engine" and settings.grpc_transport == "envoy":
            command = envoy.command(settings, self.runtime, envoy_index(role))
            process = subprocess.Popen(command, env={**env, **envoy.environment()}, stdin=subprocess.PIPE)
        else:
            process = subprocess.Popen([sys.executable, "-m", "service"], env=env)
        child = _Child(role, process)
        self._children.append(child)
        return child

    def _reserve_ports(self) -> Settings:
        """Hold the front ends' ports (resolving port 0): the settings the children get."""
        settings = self.settings
        ports = {}
        for name in ("grpc_port", "http_port", "health_port"):
            port = getattr(settings, name)
            if name == "grpc_port" or port:
                reserved = _reserved_port(settings.host, port)
                self._reserved.append(reserved)
                ports[name] = reserved.getsockname()[1]
        return dataclasses.replace(settings, **ports)

    def _metrics(self) -> None:
        """Serve /metrics: every process's figures (and, with --triton-metrics, Triton's), read when scraped."""
        registry = CollectorRegistry()
        MultiProcessCollector(registry, str(self.runtime / METRICS_FOLDER))
        tables = StatisticsTables()
        tables.share_in(self.runtime / STATISTICS_FOLDER)
        registry.register(LiveGauges(tables))
        if self.settings.triton_metrics:
            registry.register(TritonMetricsCollector(tables))
        start_http_server(self.settings.metrics_port, addr=self.settings.host, registry=registry)

    def _request_stop(self, signum: int, frame: object) -> None:
        self._stop_requested = True

    def run(self) -> int:
        """Serve until SIGTERM or SIGINT (exit 0 once every process drained) or until a process dies (non-zero)."""
        set_title("supervisor")
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._request_stop)
        try:
            try:
                settings = self._reserve_ports()
                self._metrics()
            except OSError as error:
                print(f"service: error: {error}", file=sys.stderr)
                return 2
            started = roles(settings)
            for role in started:
                self._spawn(role, settings)
            log.info("started %s (supervisor pid %d)", ", ".join(started), os.getpid())
            while not self._stop_requested:
                for child in self._children:
                    if child.exited is not None:
                        return self._stop_after(child.role, child.exited)
                time.sleep(POLL_S)
            return self._drain()
        finally:
            for reserved in self._reserved:
                reserved.close()
            shutil.rmtree(self.runtime, ignore_errors=True)

    def _stop_after(self, role: str, code: int) -> int:
        """A process stopped on its own: stop the others and exit non-zero (2 if it could not start)."""
        log.error("%s exited with status %d: stopping the server", role, code)
        self._terminate([child for child in self._children if child.exited is None], STOP_GRACE_S)
        return 2 if code == 2 else 1

    def _drain(self) -> int:
        """Front ends first (they answer what they accepted, through the engine), then the engine."""
        grace = self.settings.drain_timeout_s + STOP_GRACE_S
        frontends = [child for child in self._children if child.role != "engine"]
        engines = [child for child in self._children if child.role == "engine"]
        self._terminate(frontends, grace)
        self._terminate(engines, grace)
        codes = [child.exited for child in self._children]
        return 0 if all(code == 0 for code in codes) else 1

    @staticmethod
    def _terminate(children: list[_Child], grace_s: float) -> None:
        """SIGTERM, then SIGKILL whatever still runs after grace_s."""
        for child in children:
            if child.exited is None:
                child.request_stop()
        deadline = time.monotonic() + grace_s
        for child in children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.process.wait(max(0.0, deadline - time.monotonic()))
            if child.exited is None:
                log.error("%s did not stop within %.0f s: killed", child.role, grace_s)
                child.process.kill()
                child.process.wait()


def children(pid: int) -> Iterator[int]:
    """The pids of a process's children (/proc), for measuring and tests."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            yield from (int(child) for child in (task / "children").read_text().split())
