"""OpenTelemetry tracing: one span per inference request, a child per stage, one span per model batch.

Off unless an OTLP endpoint is given (--otlp-endpoint, or OTEL_EXPORTER_OTLP_ENDPOINT /
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT); the OpenTelemetry SDK is then never imported, no tracer
provider or exporter thread exists, and every call here returns at once: `ON` is False, request
traces are None and stages a shared no-op context. On, each process (a lone server, the engine,
each front end) configures its own tracer provider from the standard OTEL_* variables (service
name, resource attributes, sampler, the exporter's protocol, headers, timeout and TLS, the batch
processor's queue) and exports over OTLP from one background thread.

A request's span joins the caller's trace when the gRPC metadata or HTTP headers carry a W3C
`traceparent` (and `tracestate`); the envelope (service.envelope) starts it and ends it with the
status its protocol answered. A stream's messages each get a span in the stream's caller's trace.
Its children are the stages: decode, validate, tokenize, queue (waiting for a batch) and encode.
A model batch has one span of its own, where the batch runs (the engine process with --frontends > 1:
a request's span context crosses the IPC boundary as 25 bytes), linked to the span of every sampled
request whose rows it ran, and the child of the first of them.

The exporter never holds up or fails a request: ended spans go into the batch processor's bounded
queue (OTEL_BSP_MAX_QUEUE_SIZE) and are exported from its thread; a span that finds the queue
full, and spans the receiver did not take, are dropped and counted in
encoder_trace_spans_dropped_total.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Awaitable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from service.errors import ServiceError
from service.ops import metrics
from service.ops.settings import Settings, SettingsError

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
    from opentelemetry.trace import SpanContext, Tracer

log = logging.getLogger(__name__)

ON = False
"""Whether this process traces (set once by `configure`)."""
PROTOCOLS = ("grpc", "http/protobuf")
DEFAULT_PROTOCOL = "grpc"
DEFAULT_SERVICE_NAME = "encoder-serve"
DEFAULT_MAX_QUEUE_SIZE = 2048
"""The batch processor's queue when OTEL_BSP_MAX_QUEUE_SIZE is unset (the SDK's own default)."""
DEFAULT_MAX_EXPORT_BATCH_SIZE = 512
"""Spans per export when OTEL_BSP_MAX_EXPORT_BATCH_SIZE is unset (the SDK's own default)."""
EXPORTER_THREAD_NAME = "otel-export"
"""The exporter thread's name in the OS (`top -H`, /proc/PID/task/*/comm)."""
SHUTDOWN_TIMEOUT_S = 5.0
"""At exit, how long the spans still queued may take to leave (a receiver that is down must not hold the exit)."""
GRPC_SERVICE = "inference.GRPCInferenceService"
WIRE_BYTES = 25
"""A span context as it crosses the IPC boundary: trace id (16 bytes), span id (8), flags (1)."""
_NO_TRACE = contextlib.nullcontext()
"""What every call hands back while tracing is off: `with` it costs a few hundred nanoseconds."""

_tracer: Tracer | None = None
_provider: TracerProvider | None = None
_propagator: Any = None

Result = TypeVar("Result", bound="QueuedWork")


class QueuedWork(Protocol):
    """What the batcher hands back (service.core.rows.WorkResult): where the request's time went."""

    queue_s: float
    batch_rows: int


def protocol_from_environment() -> str:
    """The OTLP protocol asked for (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else OTEL_EXPORTER_OTLP_PROTOCOL); checked."""
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or DEFAULT_PROTOCOL
    ).strip()
    if protocol not in PROTOCOLS:
        raise SettingsError(f"OTEL_EXPORTER_OTLP_PROTOCOL must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    return protocol


def wanted(settings: Settings) -> bool:
    """Whether tracing is asked for: an OTLP endpoint in the settings or the environment, and the SDK not disabled."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return bool(
        settings.otlp_endpoint
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


def check(settings: Settings) -> None:
    """Refuse (SettingsError) tracing variables that `configure` would refuse, without configuring anything."""
    if wanted(settings):
        protocol_from_environment()
        _max_queue_size()
        _positive("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", DEFAULT_MAX_EXPORT_BATCH_SIZE)


def _positive(variable: str, default: int) -> int:
    text = os.environ.get(variable, "").strip()
    if not text:
        return default
    if not text.isdigit() or int(text) < 1:
        raise SettingsError(f"{variable} must be a positive integer, got {text!r}")
    return int(text)


def _max_queue_size() -> int:
    return _positive("OTEL_BSP_MAX_QUEUE_SIZE", DEFAULT_MAX_QUEUE_SIZE)


def configure(settings: Settings, role: str) -> bool:
    """Start tracing in this process if asked for (see `wanted`); whether it is on. SettingsError if misconfigured."""
    global ON, _tracer, _provider, _propagator  # noqa: PLW0603 - set once, at start, before any request
    if not wanted(settings):
        return False
    protocol = protocol_from_environment()
    capacity = _max_queue_size()
    # Here, not at the top: a server without tracing never imports the SDK.
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource  # noqa: PLC0415
    from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator  # noqa: PLC0415

    resource = Resource.create({"encoder.role": role})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    provider = TracerProvider(resource=resource)  # the sampler from OTEL_TRACES_SAMPLER / _ARG
    before = set(threading.enumerate())
    provider.add_span_processor(_CountingProcessor(_exporter(protocol, settings.otlp_endpoint), capacity))
    _name_threads(set(threading.enumerate()) - before)
    for reason in ("queue_full", "export_failed"):
        metrics.TRACE_SPANS_DROPPED.labels(reason)
    _provider, _tracer = provider, provider.get_tracer("encoder-serve")
    _propagator = TraceContextTextMapPropagator()
    ON = True
    log.info(
        "tracing: OTLP %s to %s",
        protocol,
        settings.otlp_endpoint or "the endpoint in OTEL_EXPORTER_OTLP_*",
    )
    return True


def _exporter(protocol: str, endpoint: str) -> SpanExporter:
    """The OTLP exporter: `endpoint` (a base URL, as OTEL_EXPORTER_OTLP_ENDPOINT) or the OTEL_* variables' own."""
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter  # noqa: PLC0415

        return OTLPSpanExporter(endpoint=endpoint or None)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # noqa: PLC0415
        OTLPSpanExporter as HttpSpanExporter,
    )

    # As for OTEL_EXPORTER_OTLP_ENDPOINT, the traces' path is added to a base URL.
    return HttpSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces" if endpoint else None)


def _name_threads(threads: Iterable[threading.Thread]) -> None:
    """Name the threads the SDK started in the OS, so `top -H` and /proc show what they are."""
    for thread in threads:
        if thread.native_id is not None:
            with contextlib.suppress(OSError), open(f"/proc/self/task/{thread.native_id}/comm", "w") as comm:
                comm.write(EXPORTER_THREAD_NAME)


def shutdown() -> None:
    """Export what is queued (for at most SHUTDOWN_TIMEOUT_S) and stop the exporter; nothing when off."""
    global ON  # noqa: PLW0603
    if _provider is None:
        return
    ON = False
    flushing = threading.Thread(target=_provider.shutdown, name="otel-shutdown", daemon=True)
    flushing.start()
    flushing.join(SHUTDOWN_TIMEOUT_S)


class _CountingProcessor:
    """In front of the SDK's BatchSpanProcessor: hands it a span only while its queue has room, counts the rest.

    The batch processor's own queue drops the oldest span when full and says so only in a log line.
    This one keeps its own count of spans handed over and not yet taken by the exporter (never
    below the queue's length, so the queue itself never overflows), refuses a span at capacity,
    and counts it in encoder_trace_spans_dropped_total{reason="queue_full"}; spans the exporter
    failed to deliver are counted there too (reason="export_failed").
    """

    def __init__(self, exporter: SpanExporter, capacity: int) -> None:
        from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: PLC0415

        self._capacity = capacity
        self._queued = 0
        self._lock = threading.Lock()
        # The SDK refuses an export batch larger than the queue: a small OTEL_BSP_MAX_QUEUE_SIZE caps the batch too.
        batch_size = min(capacity, _positive("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", DEFAULT_MAX_EXPORT_BATCH_SIZE))
        self._batch: SpanProcessor = BatchSpanProcessor(
            _CountedExporter(exporter, self), max_queue_size=capacity, max_export_batch_size=batch_size
        )

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        """Nothing to do at a span's start."""

    def _on_ending(self, span: Span) -> None:
        """Nothing to do as a span ends (the SDK calls this before on_end)."""

    def on_end(self, span: ReadableSpan) -> None:
        """Queue an ended span for export, or drop it (counted) when the queue is full."""
        with self._lock:
            room = self._queued < self._capacity
            if room:
                self._queued += 1
        if room:
            self._batch.on_end(span)
        else:
            metrics.TRACE_SPANS_DROPPED.labels("queue_full").inc()

    def taken(self, count: int) -> None:
        """The exporter took `count` spans out of the queue."""
        with self._lock:
            self._queued -= count

    def shutdown(self) -> None:
        """Export what is queued, then stop the exporter thread."""
        self._batch.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Export what is queued now."""
        return self._batch.force_flush(timeout_millis)


class _CountedExporter:
    """The OTLP exporter, telling the counting processor what left its queue and counting what failed."""

    def __init__(self, exporter: SpanExporter, processor: _CountingProcessor) -> None:
        self._exporter = exporter
        self._processor = processor

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Export a batch (on the batch processor's thread)."""
        from opentelemetry.sdk.trace.export import SpanExportResult  # noqa: PLC0415

        self._processor.taken(len(spans))
        result = SpanExportResult.FAILURE
        try:
            result = self._exporter.export(spans)
        finally:
            if result is not SpanExportResult.SUCCESS:
                metrics.TRACE_SPANS_DROPPED.labels("export_failed").inc(len(spans))
        return result

    def shutdown(self) -> None:
        """Stop the exporter."""
        self._exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Nothing is held here."""
        return self._exporter.force_flush(timeout_millis)


def _now_ns() -> int:
    return time.time_ns()


def _error_status(span: Span, error: BaseException) -> None:
    from opentelemetry.trace import Status, StatusCode  # noqa: PLC0415

    # A ServiceError's message is what the caller is told; anything else is named by its type only.
    description = str(error) if isinstance(error, ServiceError) else type(error).__name__
    span.set_status(Status(StatusCode.ERROR, description))


class _Stage:
    """A child span of a request's, from `with` to its end (ERROR if an exception leaves it)."""

    __slots__ = ("_span",)

    def __init__(self, span: Span) -> None:
        self._span = span

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, traceback: object) -> None:
        if error is not None:
            _error_status(self._span, error)
        self._span.end()


@dataclass(frozen=True, slots=True)
class RequestSpan:
    """What a request's span is called and says, read once where the request entered (`rpc_span`, `http_span`).

    A stream's messages each get a span made from their stream's: its children in the caller's trace.
    """

    name: str
    attributes: dict[str, str]
    status_attribute: str
    """Where its protocol's status goes when it ends (rpc.grpc.status_code, http.response.status_code)."""
    error_from_status: int
    """The first status that marks it ERROR (gRPC: anything but OK; HTTP: from 500 on, as OpenTelemetry says)."""
    parent: Context | None
    """The caller's span, from its W3C `traceparent` (and `tracestate`), if it sent one."""


class RequestTrace:
    """One request's span: its stages as children, what it asked and how it ended.

    Made by `start` (never while tracing is off: callers hold None then).
    """

    __slots__ = ("_context", "_error_from_status", "_recording", "_status_attribute", "span", "span_context")

    def __init__(self, request: RequestSpan) -> None:
        from opentelemetry.trace import SpanKind, set_span_in_context  # noqa: PLC0415

        self.span: Span = _tracer.start_span(
            request.name, context=request.parent, kind=SpanKind.SERVER, attributes=request.attributes
        )
        self.span_context: SpanContext = self.span.get_span_context()
        """What a batch span links to (and crosses the IPC boundary)."""
        self._context = set_span_in_context(self.span)
        self._status_attribute = request.status_attribute
        self._error_from_status = request.error_from_status
        self._recording = self.span.is_recording()
        """False when the sampler left the request out: its stages are not recorded either (they cost as much)."""

    def stage(self, name: str) -> contextlib.AbstractContextManager[None]:
        """A child span for one stage of the request, ended when the `with` block ends."""
        if not self._recording:
            return _NO_TRACE
        return _Stage(_tracer.start_span(name, context=self._context))

    def describe(self, model: str, version: str) -> None:
        """The model the request named."""
        self.span.set_attributes({"encoder.model": model, "encoder.model_version": version})

    def answered(self, rows: int, tokens: int, batch_size: int) -> None:
        """The request's rows, real tokens and the largest batch its rows rode in."""
        self.span.set_attributes({"encoder.rows": rows, "encoder.tokens": tokens, "encoder.batch_size": batch_size})

    async def queued(self, work: Awaitable[Result]) -> Result:
        """Await the batcher's answer, recording the wait for a batch as the `queue` stage."""
        if not self._recording:
            return await work
        started = _now_ns()
        try:
            result = await work
        except BaseException as error:
            span = _tracer.start_span("queue", context=self._context, start_time=started)
            _error_status(span, error)
            span.end()
            raise
        span = _tracer.start_span(
            "queue", context=self._context, start_time=started, attributes={"encoder.batch_size": result.batch_rows}
        )
        span.end(end_time=started + int(result.queue_s * 1e9))
        return result

    def end(self, status: int, error: BaseException | None) -> None:
        """The request ended with its protocol's `status` (ERROR from `error_from_status` on) and `error`, if any."""
        self.span.set_attribute(self._status_attribute, status)
        if status >= self._error_from_status:
            if error is None:
                from opentelemetry.trace import Status, StatusCode  # noqa: PLC0415

                self.span.set_status(Status(StatusCode.ERROR))
            else:
                _error_status(self.span, error)
        self.span.end()


def start(request: RequestSpan | None) -> RequestTrace | None:
    """A request's span, started now (None without a span to start)."""
    return None if request is None else RequestTrace(request)


def stage(trace: RequestTrace | None, name: str) -> contextlib.AbstractContextManager[None]:
    """A child span of the request's for one stage, for a `with` block; nothing without a trace."""
    return _NO_TRACE if trace is None else trace.stage(name)


def _parent(headers: Iterable[tuple[str | bytes, str | bytes]]) -> Context | None:
    """The caller's span from its `traceparent` and `tracestate` headers (gRPC metadata, HTTP headers), if any."""
    carrier = {}
    for key, value in headers:
        name = key if isinstance(key, str) else key.decode("latin-1")
        if name in ("traceparent", "tracestate"):
            carrier[name] = value if isinstance(value, str) else value.decode("latin-1")
    if "traceparent" not in carrier:
        return None
    return _propagator.extract(carrier)


def rpc_span(method: str, metadata: Iterable[tuple[str, str | bytes]] | None) -> RequestSpan | None:
    """What a gRPC call's span is (None while tracing is off); its parent from the call's metadata."""
    if not ON:
        return None
    return RequestSpan(
        f"{GRPC_SERVICE}/{method}",
        {"rpc.system": "grpc", "rpc.service": GRPC_SERVICE, "rpc.method": method},
        "rpc.grpc.status_code",
        1,
        _parent(metadata or ()),
    )


def http_span(method: str, route: str, headers: Iterable[tuple[bytes, bytes]]) -> RequestSpan | None:
    """What an HTTP request's span is (None while tracing is off); its parent from its headers."""
    if not ON:
        return None
    return RequestSpan(
        f"{method} {route}",
        {"http.request.method": method, "http.route": route},
        "http.response.status_code",
        500,
        _parent(headers),
    )


def to_wire(span_context: SpanContext | None) -> bytes | None:
    """A request's span context as it crosses the IPC boundary (WIRE_BYTES), or None."""
    if span_context is None:
        return None
    return (
        span_context.trace_id.to_bytes(16, "big")
        + span_context.span_id.to_bytes(8, "big")
        + bytes((int(span_context.trace_flags),))
    )


def from_wire(wire: bytes | None) -> SpanContext | None:
    """The span context `to_wire` sent (None when this process does not trace)."""
    if wire is None or not ON or len(wire) != WIRE_BYTES:
        return None
    from opentelemetry.trace import SpanContext, TraceFlags  # noqa: PLC0415

    return SpanContext(int.from_bytes(wire[:16], "big"), int.from_bytes(wire[16:24], "big"), True, TraceFlags(wire[24]))


def start_batch(
    labels: Sequence[str], requests: Iterable[SpanContext | None], rows: int, padded_tokens: int, tokens: int
) -> Span | None:
    """A model batch's span, linked to every sampled request in it (the child of the first); None if none is sampled."""
    contexts = list(requests)
    sampled = [context for context in contexts if context is not None and context.trace_flags.sampled]
    if not sampled:
        return None
    from opentelemetry.trace import Link, NonRecordingSpan, set_span_in_context  # noqa: PLC0415

    return _tracer.start_span(
        "batch",
        context=set_span_in_context(NonRecordingSpan(sampled[0])),
        links=[Link(context) for context in sampled],
        attributes={
            "encoder.model": labels[0],
            "encoder.model_version": labels[1],
            "encoder.batch_size": rows,
            "encoder.batch_tokens": padded_tokens,
            "encoder.tokens": tokens,
            "encoder.requests": len(contexts),
        },
    )


def end_batch(span: Span, error: BaseException | None) -> None:
    """A model batch came back (ERROR if its run failed)."""
    if error is not None:
        _error_status(span, error)
    span.end()
