"""Command line: `python -m service --model-repository DIR` (see --help for every setting)."""

from __future__ import annotations

import dataclasses
import logging
import sys

from service.launch import envoy, processes
from service.ops import tracing
from service.ops.security import SecurityError, check_files
from service.ops.settings import SettingsError, load_settings

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    """Parse settings, serve until signalled; configuration problems are one line and exit 2.

    With more than one front end this process supervises the others (service.launch.processes); each of
    them comes back here and runs its role.
    """
    child = processes.child_settings()
    if child is None:
        try:
            settings = load_settings(argv)
        except SettingsError as error:
            print(f"service: error: {error}", file=sys.stderr)
            return 2
        transport, fallback_reason = envoy.chosen_transport(settings.grpc_transport)
        settings = dataclasses.replace(settings, frontends=processes.frontends(settings), grpc_transport=transport)
        several = settings.frontends > 1 or settings.grpc_transport == "envoy"
        role = "supervisor" if several else "server"
    else:
        role, settings, runtime = child
        processes.prepare_child(role, runtime)
        fallback_reason = None
    processes.configure_logging(settings, role)
    if fallback_reason is not None:
        log.warning("the gRPC port is served by grpcio: Envoy cannot be used here (%s)", fallback_reason)
    if role == "supervisor":
        try:
            check_files(settings.tls_cert, settings.tls_key, settings.tls_client_ca, settings.api_key_file)
            tracing.check(settings)  # one error line here, not one per process
            if settings.grpc_transport == "envoy" and (reason := envoy.unusable_reason()) is not None:
                raise SettingsError(f"--grpc-transport envoy cannot be used: {reason}")
        except (SecurityError, SettingsError) as error:
            print(f"service: error: {error}", file=sys.stderr)
            return 2
        return processes.Supervisor(settings).run()
    # Imported here: the supervisor, which lives as long as the server, never loads the modules of the
    # roles it starts (the engine's and the front ends': numpy, the pipeline, grpc's server; ~25 MB of RSS).
    from service.launch.roles import run_role  # noqa: PLC0415

    return run_role(role, settings)


if __name__ == "__main__":
    sys.exit(main())
