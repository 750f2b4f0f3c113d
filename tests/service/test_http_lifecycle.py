"""The HTTP port's life: its setting, binding, and the drain on SIGTERM next to the gRPC port."""

from __future__ import annotations

import http.client
import json
import os
import socket
import time
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from service.settings import SettingsError, load_settings
from tests.conftest import TINY_MODEL
from tests.servers import (
    RunningServer,
    failed_start,
    health_status,
    server_pids,
    start_server,
    wait_for_queue_depth,
)

EXIT_TIMEOUT_S = 60
"""Bounds the wait for an exit that should come; a server that hangs fails the test instead of blocking it."""


def test_the_http_port_setting() -> None:
    assert load_settings([]).http_port == 8000
    assert load_settings([], {"ENCODER_HTTP_PORT": "0"}).http_port == 0
    with pytest.raises(SettingsError, match="must differ"):
        load_settings(["--http-port", "8001"])
    with pytest.raises(SettingsError, match="http_port must be 0-65535"):
        load_settings(["--http-port", "70000"])
    with pytest.raises(SettingsError, match="max_embedding_inputs must be at least 1"):
        load_settings(["--max-embedding-inputs", "0"])


def listening_ports(server: RunningServer) -> set[int]:
    """TCP ports the server's processes listen on: their socket inodes, looked up in /proc/net/tcp (0A is LISTEN)."""
    inodes = set()
    for pid in server_pids(server):
        for descriptor in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(descriptor)
            except FileNotFoundError:  # closed by the server between listing and reading
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_the_http_port_listens_and_port_zero_turns_it_off(
    tiny_server: RunningServer, tiny_repository: Path, tmp_path: Path
) -> None:
    served = {tiny_server.grpc_port, tiny_server.metrics_port}
    assert listening_ports(tiny_server) == served | {tiny_server.http_port}
    with start_server(tiny_repository, tmp_path / "server.log", "--http-port", "0") as server:
        assert listening_ports(server) == {server.grpc_port, server.metrics_port}
        assert "HTTP on" not in server.log()


def test_a_taken_http_port_is_a_one_line_startup_error(tiny_repository: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        finished = failed_start(tiny_repository, "--http-port", str(port), timeout_s=EXIT_TIMEOUT_S)
    assert finished.returncode == 2
    assert "service: error:" in finished.stderr and "Address already in use" in finished.stderr


def request(server: RunningServer, method: str, path: str, payload: object = None) -> tuple[int, bytes]:
    status, _, content = request_with_headers(server, method, path, payload)
    return status, content


def request_with_headers(
    server: RunningServer, method: str, path: str, payload: object = None
) -> tuple[int, http.client.HTTPMessage, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    try:
        body = None if payload is None else json.dumps(payload)
        connection.request(method, path, body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.headers, response.read()
    finally:
        connection.close()


def wait_until_not_serving(server: RunningServer) -> None:
    """Wait for the server's own health to say NOT_SERVING (it has begun to drain)."""
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    while health_status(server.target) != health_pb2.HealthCheckResponse.NOT_SERVING:
        assert time.monotonic() < deadline, "the server never reported NOT_SERVING"
        time.sleep(0.02)


def test_sigterm_drains_http_with_grpc(tiny_repository: Path, tmp_path: Path) -> None:
    flags = ("--max-queue-delay-us", "600000000", "--drain-timeout-s", "300")
    with start_server(tiny_repository, tmp_path / "server.log", *flags) as server:
        body = json.dumps({"model": TINY_MODEL, "input": "accepted before the drain"}).encode()
        held = socket.create_connection(("127.0.0.1", server.http_port), timeout=30)
        try:
            held.sendall(
                b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            wait_for_queue_depth(server, 1, TINY_MODEL)
            server.terminate()
            wait_until_not_serving(server)
            # Draining: new work over HTTP is refused 503 by both APIs.
            late_embedding = {"model": TINY_MODEL, "input": "late"}
            status, headers, content = request_with_headers(server, "POST", "/v1/embeddings", late_embedding)
            assert status == 503 and "shutting down" in json.loads(content)["error"]["message"]
            assert headers["retry-after"] == "1"
            late = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["late"]}]}
            status, content = request(server, "POST", f"/v2/models/{TINY_MODEL}/infer", late)
            assert status == 503 and "shutting down" in json.loads(content)["error"]
            assert request(server, "GET", "/v2/health/ready")[0] == 503
            assert request(server, "GET", f"/v2/models/{TINY_MODEL}/ready")[0] == 503
            assert request(server, "GET", "/v2/health/live")[0] == 200
            assert server.process.poll() is None  # the accepted request holds the drain
        finally:
            held.close()
        # Its client left: the request leaves the queue, and the drain has nothing left to wait for.
        assert server.process.wait(timeout=EXIT_TIMEOUT_S) == 0
    assert " ERROR " not in server.log()
