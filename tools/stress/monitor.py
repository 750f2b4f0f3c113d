"""What the stress suite watches while it runs: a small probe request, a health check and the server's memory.

They run in a separate process (spawned, so it shares no gRPC state with the load), so the probe's
latency is the server's, not the load generator's own event loop stalling under thousands of
calls. Times are `time.monotonic()`, one clock for every process on the machine. The probe can be
paused, so that checking the server's in-flight gauges after a phase does not count the probe. The
health check (grpc.health.v1, as kubelet sends it: no API key) never waits on the model, so its
latency is the server's event loop and transport alone.
"""

from __future__ import annotations

import ipaddress
import multiprocessing
import multiprocessing.connection
import multiprocessing.synchronize
import os
import re
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import MAX_MESSAGE_BYTES
from client.protocol import channel_options, text_request
from protocol import grpc_service_pb2_grpc as pb_grpc
from protocol.channel_security import ClientSecurity
from tools.local_server import process_cpu_seconds

PROBE_TEXT = "A short sentence to see how long a small request waits."
_LISTEN = "0A"
_VMRSS = re.compile(r"^VmRSS:\s+(\d+)\s+kB$", re.MULTILINE)
_START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Probe:
    """One probe request or health check: when it was sent, how long it took, and its status name.

    A health check that is answered but not SERVING has that status as its code (NOT_SERVING...).
    """

    sent_at: float
    latency_s: float
    code: str


@dataclass(frozen=True)
class RssSample:
    """The server's resident memory at one moment."""

    at: float
    rss_bytes: int


@dataclass(frozen=True)
class MonitorSettings:
    """What the monitor process needs (picklable)."""

    target: str
    model: str
    security: ClientSecurity
    server_pid: int | None
    health_target: str | None = None
    """The server's plaintext health port; None: health is checked on `target`, with `security`."""
    probe_interval_s: float = 0.05
    """Time from one probe's start to the next one's, at least (probes are sequential)."""
    probe_timeout_s: float = 10.0
    rss_interval_s: float = 0.1


def read_rss_bytes(pid: int) -> int | None:
    """VmRSS of a process from /proc, or None when it is gone or not readable."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    found = _VMRSS.search(text)
    return None if found is None else int(found.group(1)) * 1024


def read_cpu_seconds(pid: int) -> float | None:
    """User plus system CPU time of a process so far, from /proc; None when gone or not readable."""
    try:
        return process_cpu_seconds(pid)
    except OSError:
        return None


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if local_port == port and fields[3] == _LISTEN:
                inodes.add(fields[9])
    return inodes


def find_listening_pid(port: int) -> int | None:
    """The process on this machine listening on a TCP port, when /proc lets us see it; else None."""
    inodes = _listening_inodes(port)
    if not inodes:
        return None
    wanted = {f"socket:[{inode}]" for inode in inodes}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            descriptors = list((entry / "fd").iterdir())
        except OSError:
            continue
        for descriptor in descriptors:
            try:
                if os.readlink(descriptor) in wanted:
                    return int(entry.name)
            except OSError:
                continue
    return None


def is_local_host(host: str) -> bool:
    """Whether a host name or address is this machine's loopback (where /proc shows the server)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(address).is_loopback for address in addresses)


def _sample_rss(pid: int, interval_s: float, stop: multiprocessing.synchronize.Event, samples: list[RssSample]) -> None:
    while not stop.is_set():
        rss = read_rss_bytes(pid)
        if rss is None:
            return
        samples.append(RssSample(time.monotonic(), rss))
        stop.wait(interval_s)


@dataclass(frozen=True)
class _Signals:
    """Events shared with the monitor process."""

    stop: multiprocessing.synchronize.Event
    probing: multiprocessing.synchronize.Event
    """Set while probes may be sent; cleared to pause."""
    idle: multiprocessing.synchronize.Event
    """Set by the probe loop once it noticed a pause and has no probe in flight."""
    ready: multiprocessing.synchronize.Event
    """Set once the first probe was answered (or failed)."""


def _probe_loop(settings: MonitorSettings, signals: _Signals, probes: list[Probe]) -> None:
    options = [*channel_options(settings.target, MAX_MESSAGE_BYTES), ("grpc.enable_retries", 0)]
    request = text_request(settings.model, [PROBE_TEXT])
    metadata = settings.security.metadata()
    with settings.security.channel(settings.target, options) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        while not signals.stop.is_set():
            if not signals.probing.is_set():
                signals.idle.set()
                signals.probing.wait(settings.probe_interval_s)
                continue
            signals.idle.clear()
            sent_at = time.monotonic()
            try:
                stub.ModelInfer(request, timeout=settings.probe_timeout_s, metadata=metadata)
                code = "OK"
            except grpc.RpcError as error:
                code = error.code().name
            probes.append(Probe(sent_at, time.monotonic() - sent_at, code))
            signals.ready.set()
            signals.stop.wait(max(0.0, sent_at + settings.probe_interval_s - time.monotonic()))


def _health_loop(settings: MonitorSettings, stop: multiprocessing.synchronize.Event, checks: list[Probe]) -> None:
    request = health_pb2.HealthCheckRequest(service="")
    serving = health_pb2.HealthCheckResponse.SERVING
    options = [("grpc.enable_retries", 0)]
    if settings.health_target is None:
        channel = settings.security.channel(settings.target, options)
    else:
        channel = grpc.insecure_channel(settings.health_target, options)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while not stop.is_set():
            sent_at = time.monotonic()
            try:
                status = stub.Check(request, timeout=settings.probe_timeout_s).status
                code = "OK" if status == serving else health_pb2.HealthCheckResponse.ServingStatus.Name(status)
            except grpc.RpcError as error:
                code = error.code().name
            checks.append(Probe(sent_at, time.monotonic() - sent_at, code))
            stop.wait(max(0.0, sent_at + settings.probe_interval_s - time.monotonic()))


def _monitor_main(
    settings: MonitorSettings, connection: multiprocessing.connection.Connection, signals: _Signals
) -> None:
    """The monitor process: probe, check health and sample until told to stop, then send everything back."""
    probes: list[Probe] = []
    checks: list[Probe] = []
    samples: list[RssSample] = []
    threads = [
        threading.Thread(target=_probe_loop, args=(settings, signals, probes), daemon=True),
        threading.Thread(target=_health_loop, args=(settings, signals.stop, checks), daemon=True),
    ]
    if settings.server_pid is not None:
        args = (settings.server_pid, settings.rss_interval_s, signals.stop, samples)
        threads.append(threading.Thread(target=_sample_rss, args=args, daemon=True))
    for thread in threads:
        thread.start()
    signals.ready.wait(_START_TIMEOUT_S)
    connection.send("ready")
    connection.recv()  # the stop signal
    signals.stop.set()
    for thread in threads:
        thread.join(settings.probe_timeout_s + 5)
    connection.send((probes, checks, samples))
    connection.close()


class Monitor:
    """The probe, health check and memory sampler in a child process: `start()`, run the load, then `stop()`."""

    def __init__(self, settings: MonitorSettings) -> None:
        self.settings = settings
        context = multiprocessing.get_context("spawn")
        self._connection, child_connection = context.Pipe()
        self._signals = _Signals(context.Event(), context.Event(), context.Event(), context.Event())
        self._signals.probing.set()
        self._process = context.Process(
            target=_monitor_main, args=(settings, child_connection, self._signals), daemon=True
        )

    def start(self) -> None:
        """Start the process and wait until the first probe was answered (or failed)."""
        self._process.start()
        if not self._connection.poll(_START_TIMEOUT_S):
            self._process.kill()
            raise RuntimeError("the probe process did not start")
        self._connection.recv()

    def pause(self) -> None:
        """Stop sending probes; returns once none is in flight."""
        self._signals.idle.clear()
        self._signals.probing.clear()
        if not self._signals.idle.wait(self.settings.probe_timeout_s + 5):
            raise RuntimeError("the probe did not pause")

    def resume(self) -> None:
        """Send probes again."""
        self._signals.probing.set()

    def stop(self) -> tuple[list[Probe], list[Probe], list[RssSample]]:
        """Stop probing and sampling; every probe, health check and RSS sample taken."""
        self._connection.send("stop")
        wait_s = self.settings.probe_timeout_s + 10
        if not self._connection.poll(wait_s):
            self._process.kill()
            raise RuntimeError("the probe process did not report")
        probes, checks, samples = self._connection.recv()
        self._process.join(wait_s)
        return probes, checks, samples

    def kill(self) -> None:
        """End the process at once (after an error)."""
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
