"""Container health probe: ask the server's ``grpc.health.v1.Health/Check`` whether it is SERVING.

Usage: ``python -m service.ops.healthcheck [--target HOST:PORT] [--service NAME] [--timeout-s S]
[--tls-ca FILE [--tls-cert FILE --tls-key FILE] [--tls-server-name NAME]]``.
Exits 0 when the service is SERVING, 1 otherwise with a one-line reason on stderr; 2 on bad use.
Used by the image's Docker ``HEALTHCHECK``, and as a Kubernetes exec probe where the gRPC port
speaks TLS (kubelet's own gRPC probes cannot). The health service needs no API key.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protocol.channel_security import ClientSecurity, SecurityError, add_security_arguments, security_from_args


def default_target(environ: dict[str, str]) -> str:
    """Where the server in this container answers health in plaintext: its ENCODER_HEALTH_PORT, else its gRPC port.

    So the image's HEALTHCHECK keeps working when the gRPC port speaks TLS and a health port is set.
    """
    port = environ.get("ENCODER_HEALTH_PORT", "0").strip()
    if port in ("", "0"):
        port = environ.get("ENCODER_GRPC_PORT", "8001").strip() or "8001"
    return f"127.0.0.1:{port}"


# A probe of a loopback address must never be routed through an HTTP proxy from the environment.
_CHANNEL_OPTIONS = [("grpc.enable_http_proxy", 0)]


def _positive_seconds(text: str) -> float:
    """Parse a strictly positive number of seconds for argparse."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, ClientSecurity]:
    """Parse the command line; exits 2 on bad use (a missing certificate file included)."""
    parser = argparse.ArgumentParser(
        prog="python -m service.ops.healthcheck",
        description="Exit 0 if the gRPC health service reports SERVING, 1 otherwise.",
    )
    parser.add_argument(
        "--target",
        default=default_target(dict(os.environ)),
        help="HOST:PORT of the server (default 127.0.0.1: $ENCODER_HEALTH_PORT, else $ENCODER_GRPC_PORT, else 8001)",
    )
    parser.add_argument("--service", default="", help='service name to check ("" = the whole server)')
    parser.add_argument("--timeout-s", type=_positive_seconds, default=3.0, help="deadline of the check")
    add_security_arguments(parser, api_key=False)
    args = parser.parse_args(argv)
    try:
        return args, security_from_args(args)
    except SecurityError as error:
        parser.error(str(error))


def check(target: str, service: str, timeout_s: float, security: ClientSecurity | None = None) -> str | None:
    """Ask ``target`` for the health of ``service``; return None if SERVING, else the reason.

    ``security`` gives the TLS settings (plaintext by default).
    """
    label = repr(service) if service else "the server"
    request = health_pb2.HealthCheckRequest(service=service)
    with (security or ClientSecurity()).channel(target, _CHANNEL_OPTIONS) as channel:
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
    args, security = _parse_args(argv)
    reason = check(args.target, args.service, args.timeout_s, security)
    if reason is None:
        return 0
    sys.stderr.write(reason.replace("\n", " ") + "\n")
    return 1


if __name__ == "__main__":
    sys.exit(main())
