"""Server lifecycle: ports, services, model loading, readiness, signals and draining."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc
from prometheus_client import REGISTRY, start_http_server

from service.core.named_models import ExportFailed, export, named_models
from service.core.sources import NamedSource
from service.core.wire import EngineLink
from service.envelope import Envelope
from service.frontends.grpc.asgi import GrpcAsgiApp, StopListening
from service.frontends.grpc.health import NOT_SERVING, SERVING, HealthService
from service.frontends.grpc.interceptor import ErrorInterceptor
from service.frontends.grpc.servicer import InferenceServicer
from service.frontends.grpc.transport import (
    STREAM_AGE_SHARE,
    GenericHandlersOnly,
    add_services,
    grpc_options,
    max_send_bytes,
)
from service.frontends.http.app import HttpApp
from service.frontends.http.listener import HttpListener
from service.ops import metrics
from service.ops.message_limits import ReceiveLimits, takes_images
from service.ops.security import ReloadingSslContext, ReloadingTls, TlsFiles, api_keys, tls_files
from service.ops.settings import Settings
from service.ops.statistics import TABLES, TritonMetricsCollector
from service.pipeline.api import Pipeline
from service.pipeline.remote_models import RemoteModels

log = logging.getLogger(__name__)

OVERALL = ""
ENGINE_CONNECT_RETRY_S = 0.05
"""A front end started before the engine's socket was open tries again this often."""


def _status(serving: bool) -> int:
    return SERVING if serving else NOT_SERVING


@dataclass(frozen=True)
class FrontendRole:
    """A front-end process of a server of several: which one, and where its engine process listens."""

    index: int
    engine_socket: str


class InferenceServer:
    """The whole server (or one front end of it): start() binds and serves the models; stop() drains.

    Alone, it loads the repository's models into its own engine. As a front end (`frontend`) it
    shares its ports with the other front ends and serves the models the engine process announces.
    `hosted_by`: inside Envoy (service.launch.envoy), which holds the gRPC port and hands its
    calls to `grpc_app`; awaited at the drain, it closes Envoy's listener. Otherwise grpc.aio serves
    the port. The health port is grpc.aio's either way. Hosted, it runs under the supervisor
    (service.launch.processes), which holds the ports and serves /metrics, whether it is a front end or
    (one front end) the whole server, engine included.
    """

    def __init__(
        self, settings: Settings, frontend: FrontendRole | None = None, hosted_by: StopListening | None = None
    ) -> None:
        self.settings = settings
        self.frontend = frontend
        self.hosted_by = hosted_by
        self.grpc_app: GrpcAsgiApp | None = None
        self.pipeline = Pipeline(settings)
        self.envelope = Envelope(self.pipeline, api_keys=None)
        """Every request's envelope, over both ports; its API keys are read at start."""
        self.health = HealthService()
        self.grpc_port = 0
        self.metrics_port = 0
        self.health_port = 0
        self.http_port = 0
        self.tls = None
        self._server: grpc.aio.Server | None = None
        self._servicer = InferenceServicer(
            self.envelope, settings.max_stream_inflight, settings.max_connection_age_s * STREAM_AGE_SHARE
        )
        self._health_server: grpc.aio.Server | None = None
        self._http: HttpListener | None = None
        self._metrics_server = None
        self._background: set[asyncio.Task[None]] = set()
        self._link: EngineLink | None = None
        self._discovered: list[str] = []
        """The repository's model folders, found at bind()."""
        self._receive = ReceiveLimits.of(settings, takes_images=False)
        """The largest request each transport receives: decided at bind(), from the models the server serves."""

    async def start(self) -> None:
        """Bind the ports (health NOT_SERVING), then serve each model as it is ready: SERVING once all are."""
        await self.bind()
        await self.serve_models()

    async def bind(self) -> None:
        """Bind the ports, every service NOT_SERVING (Envoy opens its listener once this returns)."""
        settings = self.settings
        self._in_background(metrics.watch_event_loop_lag())
        metrics.ANSWER_BYTES_CAPACITY.set(self.pipeline.answers.max_in_flight_bytes)
        supervised = self.frontend is not None or self.hosted_by is not None
        reuse_port = supervised  # the supervisor holds the ports (SO_REUSEPORT) and lets its children bind them
        self._discovered = names = self.pipeline.discover()
        self._receive = ReceiveLimits.of(settings, takes_images(settings))
        files = tls_files(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
        self.tls = ReloadingTls(files) if files is not None else None
        # Each front end holds every tenant to its share of the limits (the kernel spreads connections among them).
        self.envelope.api_keys = api_keys(settings.api_key_file, 1 / max(1, settings.frontends))
        add_services(self._servicer, self.health, self._grpc_transport(ErrorInterceptor(self.envelope), reuse_port))
        for service in (OVERALL, *names):
            await self.health.set(service, NOT_SERVING)
        if self.grpc_app is not None:  # Envoy holds the port
            self.grpc_port = settings.grpc_port
        else:
            await self._start_grpc_listener()
        if settings.health_port:
            await self._start_health_listener(reuse_port)
        if settings.http_port:
            await self._start_http_listener(files, reuse_port)
        if not supervised:
            if settings.triton_metrics:
                REGISTRY.register(TritonMetricsCollector(TABLES))
            self._metrics_server, _ = start_http_server(settings.metrics_port, addr=settings.host)
            self.metrics_port = self._metrics_server.server_port
        log.info(
            "gRPC on %s:%d (%s)%s%s%s",
            settings.host,
            self.grpc_port,
            self._security_summary(),
            f", HTTP on :{self.http_port}" if self.http_port else "",
            f", metrics on :{self.metrics_port}/metrics" if self.metrics_port else "",
            f", health on :{self.health_port}" if self.health_port else "",
        )
        if not names:
            log.warning("model repository %s holds no models", settings.model_repository)
        elif not settings.serves_repository:
            log.info("serving the models given by --model only (%s is absent)", settings.model_repository)

    async def serve_models(self) -> None:
        """Load the repository's models (a front end: connect to the engine), each served once ready."""
        if self.frontend is not None:
            await self._connect(self.frontend)
            return
        by_name = {model.name: model for model in named_models(self.settings)}
        for name in self._discovered:
            started = time.perf_counter()
            if name in by_name:
                await self._export(by_name[name])
            model = await self.pipeline.load(name)
            log.info(
                "model %s version %s ready in %.1f s (%s, %s, batch <= %d rows / %d tokens, delay %d us)",
                name,
                model.spec.version,
                time.perf_counter() - started,
                model.instances[0].variant,
                model.instances[0].provider,
                model.policy.max_batch_size,
                model.policy.max_batch_tokens,
                model.policy.max_queue_delay_s * 1e6,
            )
            self._model_ready(name)

    async def _export(self, model: NamedSource) -> None:
        """Export a model given by name into the cache (or find it there); its export's stages are its state."""
        try:
            folder = await export(model, self.settings, lambda why: self.pipeline.set_state(model.name, "LOADING", why))
        except ExportFailed as error:
            self.pipeline.set_state(model.name, "UNAVAILABLE", str(error))
            raise
        self.pipeline.set_folder(model.name, folder)

    def _grpc_transport(self, interceptor: ErrorInterceptor, reuse_port: bool) -> GenericHandlersOnly | GrpcAsgiApp:
        """Where the gRPC services are registered: Envoy's application (hosted), or a grpc.aio server."""
        settings = self.settings
        if self.hosted_by is not None:
            self.grpc_app = GrpcAsgiApp(
                interceptor,
                self._receive.grpc_bytes,
                max_send_bytes(settings),
                stop_listening=self.hosted_by,
            )
            return self.grpc_app
        options = grpc_options(settings, self._receive.grpc_bytes, reuse_port)
        self._server = grpc.aio.server(interceptors=[interceptor], options=options)
        return GenericHandlersOnly(self._server)

    async def _start_grpc_listener(self) -> None:
        """grpc.aio's gRPC port, TLS as set."""
        settings = self.settings
        address = f"{settings.host}:{settings.grpc_port}"
        if self.tls is not None:
            self.grpc_port = self._server.add_secure_port(address, self.tls.credentials())
        else:
            self.grpc_port = self._server.add_insecure_port(address)
        if self.grpc_port == 0:
            raise OSError(f"cannot bind gRPC port {address}")
        await self._server.start()

    async def _connect(self, frontend: FrontendRole) -> None:
        """Connect to the engine process (once its socket is open): its models are served as it announces them."""
        models = RemoteModels(self.pipeline, self._model_ready)
        while True:
            try:
                link = await EngineLink.connect(
                    frontend.engine_socket, frontend.index, models.update, self._engine_lost
                )
            except (FileNotFoundError, ConnectionRefusedError):
                await asyncio.sleep(ENGINE_CONNECT_RETRY_S)
                continue
            self._link = models.link = link
            return

    def _engine_lost(self) -> None:
        """The engine process is gone: nothing can be served (the supervisor stops the whole server)."""
        if not self.pipeline.draining:
            log.error("the engine process is gone")
            self._publish({service: False for service in (OVERALL, *self.pipeline.served_names())})

    def _model_ready(self, name: str) -> None:
        """A model is served: its health (and the server's, once every model is) follow its instances."""
        self.pipeline.on_serving_change(name, lambda serving: self._serving_changed(name, serving))
        self._serving_changed(name, self.pipeline.model_ready(name))

    def _security_summary(self) -> str:
        transport = "plaintext" if self.tls is None else "mutual TLS" if self.tls.files.client_ca else "TLS"
        return transport + (", API keys" if self.settings.api_key_file else "")

    async def _start_health_listener(self, reuse_port: bool) -> None:
        """A plaintext port with only grpc.health.v1, for probes that cannot speak TLS (kubelet's)."""
        settings = self.settings
        self._health_server = grpc.aio.server(options=[("grpc.so_reuseport", 1 if reuse_port else 0)])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._health_server)
        self.health_port = self._health_server.add_insecure_port(f"{settings.host}:{settings.health_port}")
        if self.health_port == 0:
            raise OSError(f"cannot bind health port {settings.host}:{settings.health_port}")
        await self._health_server.start()

    async def _start_http_listener(self, tls: TlsFiles | None, reuse_port: bool) -> None:
        """The HTTP port (its route families: service.frontends.http.app), with the TLS files and envelope of gRPC."""
        settings = self.settings
        app = HttpApp(
            self.envelope,
            self._receive.http_bytes,
            settings.max_embedding_inputs,
            max(1, settings.max_concurrent_http_requests // max(1, settings.frontends)),
        )
        context = ReloadingSslContext(tls).context if tls is not None else None
        self._http = HttpListener(app, settings.host, settings.http_port, context, reuse_port)
        await self._http.start()
        self.http_port = self._http.port

    def _serving_changed(self, name: str, serving: bool) -> None:
        """A model lost (or got back) its last working instance: its health and the server's follow."""
        if not self.pipeline.draining:
            self._publish({name: serving, OVERALL: serving and self.pipeline.ready})

    def _publish(self, statuses: dict[str, bool]) -> None:
        """Set health statuses (SERVING or not) in the background."""

        async def publish() -> None:
            for service, serving in statuses.items():
                await self.health.set(service, _status(serving))

        self._in_background(publish())

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        """Run a task of the server's own, kept referenced until it ends (or the server stops it)."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def stop(self) -> None:
        """Drain: NOT_SERVING; the ports stop taking requests (gRPC's GOAWAY); accepted ones are answered; close.

        Every request the transports accepted before they stopped is answered, those queued without
        waiting for fuller batches; what is still running when --drain-timeout-s ends is cancelled.
        """
        deadline = time.monotonic() + self.settings.drain_timeout_s
        await self.health.enter_graceful_shutdown()
        self.pipeline.drain()
        self._servicer.streams.close()  # open streams answer what they accepted, then end
        await self.health.end_watches()  # they saw NOT_SERVING: they must not hold the grace period
        log.info("draining (up to %.0f s)", self.settings.drain_timeout_s)
        transports = []
        if self.grpc_app is not None:
            transports.append(self.grpc_app.stop(max(0.0, deadline - time.monotonic())))
        if self._server is not None:
            transports.append(self._server.stop(grace=max(0.0, deadline - time.monotonic())))
        if self._http is not None:
            transports.append(self._http.stop(max(0.0, deadline - time.monotonic())))
        await asyncio.gather(*transports)
        await self.pipeline.close(max(0.0, deadline - time.monotonic()))
        if self._health_server is not None:
            await self._health_server.stop(grace=0)
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        if self._link is not None:
            self._link.close()
        for task in list(self._background):
            task.cancel()
        log.info("stopped")


async def serve(settings: Settings, frontend: FrontendRole | None = None) -> int:
    """Run until SIGTERM or SIGINT, then drain and return the exit status."""
    server = InferenceServer(settings, frontend)
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
