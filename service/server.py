"""Server lifecycle: ports, services, model loading, readiness, signals and draining."""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection, reflection_pb2
from prometheus_client import start_http_server

from service.errors import ErrorInterceptor
from service.models import ModelRegistry
from service.proto import grpc_service_pb2 as pb
from service.proto import grpc_service_pb2_grpc as pb_grpc
from service.proto import model_config_pb2 as mc
from service.servicer import InferenceServicer
from service.settings import Settings

log = logging.getLogger(__name__)

INFERENCE_SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
OVERALL = ""
CONNECTION_AGE_GRACE_S = 30


def reflection_pool() -> descriptor_pool.DescriptorPool:
    """A descriptor pool holding every service served, for the reflection service.

    Our stubs live in a private pool (see service/proto/pool.py); health and reflection in the
    default one. Reflection answers from a single pool, so this one gathers all four files.
    """
    pool = descriptor_pool.DescriptorPool()
    for file in (mc.DESCRIPTOR, pb.DESCRIPTOR, health_pb2.DESCRIPTOR, reflection_pb2.DESCRIPTOR):
        proto = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(proto)
        pool.Add(proto)
    return pool


def grpc_options(settings: Settings) -> list[tuple[str, int]]:
    """Channel arguments: message size limits, and a maximum connection age so clients rebalance."""
    options = [
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    if settings.max_connection_age_s > 0:
        options += [
            ("grpc.max_connection_age_ms", int(settings.max_connection_age_s * 1000)),
            ("grpc.max_connection_age_grace_ms", CONNECTION_AGE_GRACE_S * 1000),
        ]
    return options


class InferenceServer:
    """The whole server: start() binds and loads; stop() drains and exits cleanly."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.registry = ModelRegistry(settings)
        self.health = HealthServicer()
        self.grpc_port = 0
        self.metrics_port = 0
        self._server: grpc.aio.Server | None = None
        self._metrics_server = None

    async def start(self) -> None:
        """Bind the ports (health NOT_SERVING), load and warm every model, then report SERVING."""
        settings = self.settings
        names = self.registry.discover()
        self._server = grpc.aio.server(interceptors=[ErrorInterceptor()], options=grpc_options(settings))
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(self.registry), self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection(
            (INFERENCE_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self._server,
            pool=reflection_pool(),
        )
        for service in (OVERALL, *names):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.grpc_port = self._server.add_insecure_port(f"{settings.host}:{settings.grpc_port}")
        if self.grpc_port == 0:
            raise OSError(f"cannot bind gRPC port {settings.host}:{settings.grpc_port}")
        await self._server.start()
        self._metrics_server, _ = start_http_server(settings.metrics_port, addr=settings.host)
        self.metrics_port = self._metrics_server.server_port
        log.info("gRPC on %s:%d, metrics on :%d/metrics", settings.host, self.grpc_port, self.metrics_port)
        if not names:
            log.warning("model repository %s holds no models", settings.model_repository)
        for name in names:
            started = time.perf_counter()
            model = await self.registry.load(name)
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
            log.info(
                "model %s version %s ready in %.1f s (%s, %s, batch <= %d rows / %d tokens, delay %d us)",
                name,
                model.spec.version,
                time.perf_counter() - started,
                model.variant,
                model.provider,
                model.policy.max_batch_size,
                model.policy.max_batch_tokens,
                model.policy.max_queue_delay_s * 1e6,
            )
        await self.health.set(OVERALL, health_pb2.HealthCheckResponse.SERVING)

    async def stop(self) -> None:
        """Drain: NOT_SERVING, refuse new inferences, answer accepted ones, then close within the grace period."""
        deadline = time.monotonic() + self.settings.drain_timeout_s
        await self.health.enter_graceful_shutdown()
        self.registry.draining = True
        log.info("draining (up to %.0f s)", self.settings.drain_timeout_s)
        await self.registry.close(max(0.0, deadline - time.monotonic()))
        if self._server is not None:
            await self._server.stop(grace=max(0.0, deadline - time.monotonic()))
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        log.info("stopped")


async def serve(settings: Settings) -> int:
    """Run until SIGTERM or SIGINT, then drain and return the exit status."""
    server = InferenceServer(settings)
    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop_requested.set)
    start = asyncio.create_task(server.start())
    stopping = asyncio.create_task(stop_requested.wait())
    done, _ = await asyncio.wait({start, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if start in done and start.exception() is not None:
        await server.stop()
        raise start.exception()
    await stopping
    if not start.done():
        start.cancel()
        await asyncio.gather(start, return_exceptions=True)
    await server.stop()
    return 0
