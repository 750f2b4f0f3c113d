"""What tracing costs: server CPU per one-text ModelInfer with tracing off and on, side by side.

    python -m tools.tracing_bench [--seconds 6] [--rounds 3]

A tiny random encoder (exported here by the real exporter) served three times, one process each
(`--frontends 1`): without tracing; tracing every request (OTEL_TRACES_SAMPLER=always_on); and
tracing one request in a hundred (traceidratio 0.01), both to an OTLP/gRPC receiver running in this
process (it takes the spans and drops them). Every request carries a `traceparent` (sampled), to
every server. Rounds alternate between the servers, with one
request in flight and with 32 (16 connections); each figure is the server's CPU time (user + system,
every thread, /proc) over the requests answered, the median of the rounds.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import sys
import tempfile
from concurrent import futures
from pathlib import Path

import grpc
import uvloop
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from export.build import ExportOptions, export_model
from export.checkpoints.checkpoint import default_model_folder, random_checkpoint
from tools.bench import TINY_CONFIG, TINY_MODEL
from tools.local_server import start_server
from tools.protocols_bench import model_infer_cpu


class _Sink(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP receiver that counts the spans it takes."""

    def __init__(self) -> None:
        self.spans = 0

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self.spans += sum(len(scope.spans) for spans in request.resource_spans for scope in spans.scope_spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def _traceparent() -> tuple[tuple[str, str], ...]:
    """A sampled W3C trace context of its own."""
    return (("traceparent", f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"),)


def main(argv: list[str] | None = None) -> int:
    """Measure both servers, alternating, and print the figures."""
    parser = argparse.ArgumentParser(prog="python -m tools.tracing_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="per round and load")
    parser.add_argument("--rounds", type=int, default=3)
    arguments = parser.parse_args(argv)
    sink = _Sink()
    receiver = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, receiver)
    port = receiver.add_insecure_port("127.0.0.1:0")
    receiver.start()
    traced_env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_TRACES_SAMPLER": "always_on",
    }
    sampled_env = {**traced_env, "OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.01"}
    modes = ("off", "always_on", "ratio 0.01")
    figures: dict[tuple[str, int], list[tuple[float, float]]] = {}
    try:
        with tempfile.TemporaryDirectory() as scratch:
            repository = Path(scratch) / "repository"
            checkpoint = random_checkpoint(TINY_CONFIG, TINY_MODEL, seed=1, tokenizer_folder=default_model_folder())
            export_model(checkpoint, repository, ExportOptions(variants=("fp32",), threads=1))
            flags = ("--frontends", "1", "--intra-op-threads", "1")
            with (
                start_server(repository, Path(scratch) / "off.log", *flags, env={"OTEL_SDK_DISABLED": "true"}) as off,
                start_server(repository, Path(scratch) / "on.log", *flags, env=traced_env) as on,
                start_server(repository, Path(scratch) / "ratio.log", *flags, env=sampled_env) as ratio,
            ):
                for _ in range(arguments.rounds):
                    for in_flight in (1, 32):
                        for mode, server in zip(modes, (off, on, ratio), strict=True):
                            requests, used, p50_ms = uvloop.run(
                                model_infer_cpu(server, TINY_MODEL, in_flight, arguments.seconds, _traceparent())
                            )
                            figures.setdefault((mode, in_flight), []).append((used / requests * 1e6, p50_ms))
    finally:
        receiver.stop(grace=None)
    print(f"tiny model, one-text ModelInfer, one server process each; median of {arguments.rounds} rounds:")
    for in_flight in (1, 32):
        medians = {
            mode: [statistics.median(values) for values in zip(*figures[(mode, in_flight)], strict=True)]
            for mode in modes
        }
        off_us = medians["off"][0]
        line = [f"  {in_flight:>2} in flight: tracing off {off_us:.0f} us CPU/request (p50 {medians['off'][1]:.2f} ms)"]
        for mode in modes[1:]:
            us, p50_ms = medians[mode]
            line.append(f"{mode} {us:.0f} us (+{us - off_us:.0f} us, {us / off_us - 1:+.0%}; p50 {p50_ms:.2f} ms)")
        print("; ".join(line))
    print(f"  spans received: {sink.spans}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
