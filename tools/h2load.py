"""h2load (nghttp2's load generator, in C; Debian's nghttp2-client) as the benches' client: command lines, runs.

One client for gRPC (HTTP/2, many streams per connection) and HTTP/1.1 alike, whose own CPU per
request is small next to a server's: on a machine of two CPUs a Python client beside the server
takes a share of them that differs by protocol, and a server's CPU per request rises as its rate
falls (fewer requests share each wake-up of its threads), so figures measured with it mix the
client's cost into the server's.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

from protocol import grpc_service_pb2 as pb

EXECUTABLE = "h2load"
GRPC_HEADERS = ("content-type: application/grpc", "te: trailers")
MODEL_INFER_PATH = "/inference.GRPCInferenceService/ModelInfer"
IN_FLIGHT = 32
"""The benches' load: requests in flight at once."""
GRPC_CONNECTIONS = 16
"""The HTTP/2 connections gRPC's requests in flight share (HTTP/1.1 takes a connection per request)."""
WARM_UP_REQUESTS = 256
"""Sent before a measurement counts: every connection open, every front end warm."""


def executable() -> str:
    """h2load's path; RuntimeError saying how to install it when it is not on PATH."""
    found = shutil.which(EXECUTABLE)
    if found is None:
        raise RuntimeError("h2load is not installed: install Debian's nghttp2-client (make setup does, as root)")
    return found


def grpc_body(request: pb.ModelInferRequest) -> bytes:
    """One ModelInfer call's request body: gRPC's 5-byte message prefix (uncompressed, length), then the message."""
    message = request.SerializeToString()
    return b"\0" + struct.pack(">I", len(message)) + message


def command(
    url: str,
    body: Path,
    headers: tuple[str, ...],
    *,
    connections: int,
    streams: int = 1,
    seconds: float = 0,
    requests: int = 0,
    log: Path | None = None,
) -> list[str]:
    """POST `body` to `url` for `seconds` (or `requests` times) over `connections`, `streams` in flight on each.

    `streams` 0 means HTTP/1.1 (one request in flight per connection), else HTTP/2. `log`: each
    request's status and microseconds, one tab-separated line each (latencies_ms reads it).
    """
    length = ["--duration", f"{round(seconds * 1000)}ms"] if seconds else ["--requests", str(requests)]
    protocol = ["--h1"] if streams == 0 else ["--max-concurrent-streams", str(streams)]
    logged = ["--log-file", str(log)] if log is not None else []
    header_flags = [flag for header in headers for flag in ("--header", header)]
    return [
        executable(),
        *length,
        "--clients",
        str(connections),
        *protocol,
        *logged,
        "--data",
        str(body),
        *header_flags,
        url,
    ]


def model_infer(
    target: str,
    body: Path,
    *,
    connections: int = GRPC_CONNECTIONS,
    streams: int = IN_FLIGHT // GRPC_CONNECTIONS,
    seconds: float = 0,
    requests: int = 0,
    log: Path | None = None,
) -> list[str]:
    """ModelInfer calls of `body` (grpc_body) to the gRPC port at `target` (host:port); as `command`."""
    url = f"http://{target}{MODEL_INFER_PATH}"
    length = {"seconds": seconds, "requests": requests, "log": log}
    return command(url, body, GRPC_HEADERS, connections=connections, streams=streams, **length)


def run(arguments: list[str]) -> None:
    """Run h2load; RuntimeError with what it said when it fails."""
    finished = subprocess.run(arguments, capture_output=True, text=True, check=False)
    if finished.returncode != 0:
        said = finished.stderr.strip() or finished.stdout[-500:]
        raise RuntimeError(f"h2load failed ({finished.returncode}): {said}")


def latencies_ms(log: Path) -> list[float]:
    """Each logged request's time to the end of its response, in milliseconds."""
    return [int(line.split("\t")[2]) / 1e3 for line in log.read_text().splitlines() if line]


class Answers:
    """The server's answers by status (RunningServer.answered) between h2load runs: OK, but for what timed runs left.

    A timed run ends with up to its in-flight requests unanswered, which the server counts CANCELLED in
    the reading just after the run or, when it counts them late, in a later one: each timed run allows
    that many CANCELLED once, to whichever readings find them.
    """

    def __init__(self, answered: dict[str, float]) -> None:
        self._last = answered
        self._abandoned = 0.0

    def ok_since_last(self, answered: dict[str, float], abandoned: int = 0) -> int:
        """Requests answered OK since the last reading; `abandoned`: a timed run ended since, with so many in flight.

        RuntimeError when more were cancelled than the timed runs so far abandoned, or any got another status.
        """
        codes = {code: count - self._last.get(code, 0.0) for code, count in answered.items()}
        self._last = answered
        self._abandoned += abandoned
        cancelled_of_abandoned = min(codes.get("CANCELLED", 0.0), self._abandoned)
        self._abandoned -= cancelled_of_abandoned
        codes["CANCELLED"] = codes.get("CANCELLED", 0.0) - cancelled_of_abandoned
        failed = {code: count for code, count in codes.items() if code != "OK" and count}
        if failed:
            raise RuntimeError(f"requests failed: {failed}")
        return round(codes.get("OK", 0.0))
