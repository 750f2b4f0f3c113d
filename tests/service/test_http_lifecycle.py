"""The HTTP port's life: its setting, binding, and the drain on SIGTERM next to the gRPC port."""

from __future__ import annotations

import http.client
import json
import os
import socket
from pathlib import Path

import pytest

from service.ops.settings import SettingsError, load_settings
from tests.conftest import TINY_MODEL
from tests.servers import (
    RunningServer,
    failed_start,
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


def test_sigterm_answers_http_work_accepted_before_it_and_closes_the_port(
    tiny_repository: Path, tmp_path: Path
) -> None:
    flags = ("--max-queue-delay-us", "600000000", "--drain-timeout-s", "300")
    with start_server(tiny_repository, tmp_path / "server.log", *flags) as server:
        body = json.dumps({"model": TINY_MODEL, "input": "accepted before the drain"}).encode()
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=EXIT_TIMEOUT_S) as held:
            held.sendall(
                b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            wait_for_queue_depth(server, 1, TINY_MODEL)  # held by the 600 s batching delay
            server.terminate()
            # The drain runs it at once instead of waiting out the delay, and answers it.
            answer = http.client.HTTPResponse(held)
            answer.begin()
            assert answer.status == 200
            (row,) = json.loads(answer.read())["data"]
            assert len(row["embedding"]) == 32
        assert server.process.wait(timeout=EXIT_TIMEOUT_S) == 0
        with pytest.raises(ConnectionRefusedError):  # the port is closed, not answering 503 to new clients
            socket.create_connection(("127.0.0.1", server.http_port), timeout=10)
    assert " ERROR " not in server.log()
