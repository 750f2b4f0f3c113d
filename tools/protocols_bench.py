"""HTTP against gRPC on one server, in one run: requests/s and server CPU per request for one-text embeddings.

    python -m tools.protocols_bench --repository model_repository [--model all-MiniLM-L6-v2]

One server serves both ports; closed-loop clients in this process send the same sentence as a
gRPC ModelInfer, an OpenAI /v1/embeddings request (base64, the SDK's default, and float) and a
KServe v2 REST infer with binary output, taking turns round after round so that a machine's
drift touches every protocol alike. Server CPU per request is the server process's user + system
time over the requests it answered; rows per model run (from the server's encoder_batch_size)
tell how well each front end's requests batch. The HTTP client is a minimal keep-alive HTTP/1.1 client on
asyncio streams, so the client's own cost stays close to grpc.aio's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from protocol import grpc_service_pb2 as pb
from protocol import grpc_service_pb2_grpc as pb_grpc
from tools.local_server import RunningServer, process_cpu_seconds, rows_per_run, start_server

SENTENCE = "A short sentence about serving encoders over two protocols."
PROTOCOLS = ("grpc", "openai-base64", "openai-float", "kserve-rest")

Call = Callable[[], Awaitable[None]]
CPU_CONNECTIONS = 16
"""Connections model_infer_cpu spreads its callers over."""


@dataclass(frozen=True)
class Measurement:
    """One protocol at one concurrency, in one round."""

    protocol: str
    concurrency: int
    requests: int
    seconds: float
    server_cpu_s: float
    p50_ms: float
    rows_per_run: float | None = None
    """Rows per model run while measured: how well this front end's requests batched."""

    @property
    def requests_per_s(self) -> float:
        """Closed-loop throughput."""
        return self.requests / self.seconds

    @property
    def server_cpu_us_per_request(self) -> float:
        """Server process CPU time (all threads) per answered request."""
        return 1e6 * self.server_cpu_s / self.requests


class HttpConnection:
    """One keep-alive HTTP/1.1 connection: a request written whole, the answer read by Content-Length."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> HttpConnection:
        """Connect to 127.0.0.1:port."""
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def post(self, request: bytes) -> bytes:
        """Send a prepared request; the body of a 200 answer (RuntimeError otherwise)."""
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        body = await self.reader.readexactly(length)
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"{head.splitlines()[0].decode()}: {body[:200].decode(errors='replace')}")
        return body

    def close(self) -> None:
        """Close the connection."""
        self.writer.close()


def http_request(path: str, body: bytes, headers: dict[str, str]) -> bytes:
    """A complete HTTP/1.1 POST, ready to write."""
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def http_requests(model: str) -> dict[str, bytes]:
    """The prepared HTTP request of each HTTP protocol."""
    json_type = {"Content-Type": "application/json"}
    requests = {}
    for encoding in ("base64", "float"):
        body = json.dumps({"model": model, "input": SENTENCE, "encoding_format": encoding}).encode()
        requests[f"openai-{encoding}"] = http_request("/v1/embeddings", body, json_type)
    rest = {
        "inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [SENTENCE]}],
        "outputs": [{"name": "embedding", "parameters": {"binary_data": True}}],
    }
    requests["kserve-rest"] = http_request(f"/v2/models/{model}/infer", json.dumps(rest).encode(), json_type)
    return requests


def grpc_request(model: str) -> pb.ModelInferRequest:
    """One sentence as raw BYTES, asking for the embedding only."""
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="text", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(struct.pack("<I", len(SENTENCE.encode())) + SENTENCE.encode())
    request.outputs.add(name="embedding")
    return request


async def closed_loop(calls: list[Call], seconds: float) -> tuple[int, float, float]:
    """Each call in its own loop until the time is up: (requests, elapsed seconds, p50 latency ms)."""
    latencies: list[float] = []
    until = time.perf_counter() + seconds

    async def worker(call: Call) -> None:
        while time.perf_counter() < until:
            sent = time.perf_counter()
            await call()
            latencies.append(time.perf_counter() - sent)

    started = time.perf_counter()
    await asyncio.gather(*(worker(call) for call in calls))
    return len(latencies), time.perf_counter() - started, 1e3 * statistics.median(latencies)


async def model_infer_cpu(
    server: RunningServer, model: str, in_flight: int, seconds: float, metadata: tuple[tuple[str, str], ...] = ()
) -> tuple[int, float, float]:
    """One-sentence ModelInfer callers in closed loops: (requests answered, the server's CPU seconds, p50 ms).

    `in_flight` callers over up to CPU_CONNECTIONS connections of their own, each call made once to
    warm up before the server's CPU time is read.
    """
    connections = min(in_flight, CPU_CONNECTIONS)
    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(server.target, options) for _ in range(connections)]
    stubs = [pb_grpc.GRPCInferenceServiceStub(channel) for channel in channels]
    request = grpc_request(model)
    calls = [lambda stub=stubs[i % connections]: stub.ModelInfer(request, metadata=metadata) for i in range(in_flight)]
    try:
        await asyncio.gather(*(call() for call in calls))
        before = process_cpu_seconds(server.process.pid)
        requests, _, p50_ms = await closed_loop(calls, seconds)
        used = process_cpu_seconds(server.process.pid) - before
    finally:
        for channel in channels:
            await channel.close()
    return requests, used, p50_ms


async def measure(server: RunningServer, model: str, protocol: str, concurrency: int, seconds: float) -> Measurement:
    """One closed-loop measurement, with the server's CPU time around it (connections opened and warmed first)."""
    if protocol == "grpc":
        channel = grpc.aio.insecure_channel(server.target)
        stub, request = pb_grpc.GRPCInferenceServiceStub(channel), grpc_request(model)

        async def call() -> None:
            await stub.ModelInfer(request)

        calls: list[Call] = [call] * concurrency
        closers: list[Callable[[], object]] = []
    else:
        payload = http_requests(model)[protocol]
        connections = [await HttpConnection.open(server.http_port) for _ in range(concurrency)]
        calls = [lambda c=connection: c.post(payload) for connection in connections]
        closers = [connection.close for connection in connections]
    try:
        await asyncio.gather(*(call() for call in calls))  # warm: connections made, first answers in
        batches_before = server.batch_totals(model)
        cpu_before = process_cpu_seconds(server.process.pid)
        requests, elapsed, p50_ms = await closed_loop(calls, seconds)
        cpu = process_cpu_seconds(server.process.pid) - cpu_before
        batching = rows_per_run(batches_before, server.batch_totals(model))
    finally:
        for close in closers:
            close()
        if protocol == "grpc":
            await channel.close()
    return Measurement(protocol, concurrency, requests, elapsed, cpu, p50_ms, batching)


def summary(measurements: list[Measurement]) -> list[dict[str, float | int | str]]:
    """Per protocol and concurrency: the median over rounds, and the ratio to gRPC's throughput."""
    rows = []
    keys = sorted({(m.concurrency, m.protocol) for m in measurements}, key=lambda k: (k[0], PROTOCOLS.index(k[1])))
    for concurrency, protocol in keys:
        group = [m for m in measurements if (m.concurrency, m.protocol) == (concurrency, protocol)]
        grpc_group = [m for m in measurements if (m.concurrency, m.protocol) == (concurrency, "grpc")]
        rps = statistics.median(m.requests_per_s for m in group)
        rows.append(
            {
                "protocol": protocol,
                "concurrency": concurrency,
                "requests_per_s": round(rps, 1),
                "vs_grpc": round(rps / statistics.median(m.requests_per_s for m in grpc_group), 2),
                "server_cpu_us_per_request": round(statistics.median(m.server_cpu_us_per_request for m in group)),
                "p50_ms": round(statistics.median(m.p50_ms for m in group), 2),
                "rows_per_run": round(statistics.median(m.rows_per_run or 0 for m in group), 2),
            }
        )
    return rows


async def run(server: RunningServer, options: argparse.Namespace) -> list[Measurement]:
    """Every protocol at every concurrency, round after round."""
    measurements = []
    for round_index in range(options.rounds):
        for concurrency in options.concurrency:
            for protocol in PROTOCOLS:
                measurement = await measure(server, options.model, protocol, concurrency, options.duration_s)
                measurements.append(measurement)
                print(
                    f"round {round_index + 1} {protocol:>13} x{concurrency:<3} {measurement.requests_per_s:8.1f} req/s"
                    f" {measurement.server_cpu_us_per_request:6.0f} us server CPU/request"
                    f" p50 {measurement.p50_ms:.2f} ms, {measurement.rows_per_run or 0:.1f} rows per model run",
                    file=sys.stderr,
                )
    return measurements


def main(argv: list[str] | None = None) -> int:
    """Start a server on free loopback ports, measure, print the summary as JSON."""
    parser = argparse.ArgumentParser(prog="python -m tools.protocols_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--repository", type=Path, default=Path("model_repository"))
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--threads", type=int, default=1, help="ONNX Runtime threads of the server's instance")
    parser.add_argument("--concurrency", type=lambda text: [int(n) for n in text.split(",")], default=[1, 32])
    parser.add_argument("--duration-s", type=float, default=8.0, help="per protocol, concurrency and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--output", type=Path, help="also write every measurement and the summary as JSON here")
    options = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        log_path = Path(folder) / "server.log"
        with start_server(options.repository, log_path, "--intra-op-threads", str(options.threads)) as server:
            measurements = asyncio.run(run(server, options))
    report = {"summary": summary(measurements), "measurements": [asdict(m) for m in measurements]}
    if options.output is not None:
        options.output.write_text(json.dumps(report, indent=2))
    print(json.dumps(report["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
