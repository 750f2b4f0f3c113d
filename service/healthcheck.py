"""Container health probe: ask the server's ``grpc.health.v1.Health/Check`` whether it is SERVING.

Usage: ``python -m service.healthcheck [--target HOST:PORT] [--service NAME] [--timeout-s S]``.
Exits 0 when the service is SERVING, 1 otherwise with a one-line reason on stderr. Used by the
image's Docker ``HEALTHCHECK``; Kubernetes uses its native gRPC probes instead.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

DEFAULT_TARGET = "127.0.0.1:8001"

# A probe of a loopback address must never be routed through an HTTP proxy from the environment.
_CHANNEL_OPTIONS = [("grpc.enable_http_proxy", 0)]


def _positive_seconds(text: str) -> float:
    """Parse a strictly positive number of seconds for argparse."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(
        prog="python -m service.healthcheck",
        description="Exit 0 if the gRPC health service reports SERVING, 1 otherwise.",
    )
    parser.add_argument("--target", default=DEFAULT_TARGET, help="HOST:PORT of the gRPC server")
    parser.add_argument("--service", default="", help='service name to check ("" = the whole server)')
    parser.add_argument("--timeout-s", type=_positive_seconds, default=3.0, help="deadline of the check")
    return parser.parse_args(argv)


def check(target: str, service: str, timeout_s: float) -> str | None:
    """Ask ``target`` for the health of ``service``; return None if SERVING, else the reason."""
    label = repr(service) if service else "the server"
    request = health_pb2.HealthCheckRequest(service=service)
    with grpc.insecure_channel(target, options=_CHANNEL_OPTIONS) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(request, timeout=timeout_s)
        except grpc.RpcError as error:
            code = error.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                return f"timeout: {target} did not answer within {timeout_s:g} s"
            if code == grpc.StatusCode.UNAVAILABLE:
                return f"unreachable: {target}: {error.details()}"
            if code == grpc.StatusCode.NOT_FOUND:
                return f"not serving: {target} does not know the service {label}"
            return f"not serving: {target} answered {code.name}: {error.details()}"
    if response.status != health_pb2.HealthCheckResponse.SERVING:
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
        return f"not serving: {label} at {target} is {status}"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the check and return the process exit status (0 = SERVING)."""
    args = _parse_args(argv)
    reason = check(args.target, args.service, args.timeout_s)
    if reason is None:
        return 0
    sys.stderr.write(reason.replace("\n", " ") + "\n")
    return 1


if __name__ == "__main__":
    sys.exit(main())
