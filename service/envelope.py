"""The request envelope: what happens around every request, whatever its protocol, written once.

Where a request enters (its socket's handler), its front end stamps a `RequestContext`: when it
was received, its deadline, and (once `Envelope.authenticate` has checked its key) its tenant.
Every front end then goes through the same `Envelope`, which owns the request's life from there:

- `open`: its span started (a traced request; `open_stream` for a stream, whose messages each get
  theirs from `message`, in the stream's caller's trace);
- `authenticate`: the API key, its tenant, or Unauthenticated;
- `inference`: the request's tenant admitted, the pipeline's one call (service.pipeline.api:
  `infer`, or `tokenize` and `decode`, which run no model) with the request's reservation in the
  answer budget, the tenant charged its tokens, the answer encoded, and the request counted once
  its answer is encoded (encoder_requests_total, Triton's statistics, the tenant's figures), from
  the moment it was received;
- `close`, once, when the transport has taken the answer or never will (answered, failed, client
  gone, cancelled): the answer's bytes leave the budget and the span ends with the status the
  protocol answered;
- `failed`: the error a request ends with, counted once in encoder_requests_rejected_total when
  it is a refusal at a limit, and an unplanned failure logged and turned into an internal error.

A front end only parses its wire format, renders answers and maps error kinds to its statuses
(service.frontends.grpc.status, service.frontends.http.errors).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Generic, TypeVar, overload

from service.errors import INTERNAL_MESSAGE, ServiceError, Unauthenticated
from service.ops import metrics, tracing
from service.ops.security import ApiKeys
from service.ops.tenants import Tenant
from service.pipeline.api import (
    INLINE_ENCODE_BYTES,
    DecodeRequest,
    DecodeResult,
    InferenceRequest,
    InferenceResult,
    Pipeline,
    PipelineResult,
    Reservation,
    TokenizeRequest,
    TokenizeResult,
)

log = logging.getLogger(__name__)
Encoded = TypeVar("Encoded")
Decoded = TypeVar("Decoded")
Result = TypeVar("Result", InferenceResult, TokenizeResult, DecodeResult)
PipelineRequest = InferenceRequest | TokenizeRequest | DecodeRequest
"""What a front end asks the pipeline inside the envelope: an inference, or its tokenizer's work alone."""


@dataclass(slots=True)
class RequestContext:
    """One request's envelope, stamped once where it entered the server."""

    received: float
    """When it entered (time.perf_counter): its latency and Triton's statistics count from here."""
    deadline: float | None = None
    """The caller's deadline (time.monotonic), from the transport (gRPC's grpc-timeout), if any."""
    trace: tracing.RequestTrace | None = None
    """Its span, once `Envelope.open` started it (while tracing is on and its route is traced)."""
    tenant: Tenant | None = None
    """Its tenant, once `Envelope.authenticate` accepted its key (None while keys are off)."""
    span: tracing.RequestSpan | None = None
    """A stream's: what each of its messages' spans is (`Envelope.message`)."""
    reservation: Reservation | None = None
    """Its answer's bytes in the budget, from its inference until `Envelope.close`."""
    closed: bool = False
    """Whether `Envelope.close` ended it."""


def stamp(deadline: float | None = None) -> RequestContext:
    """A request's context, received now (the caller's address is the transport's, read only for a failure's log)."""
    return RequestContext(time.perf_counter(), deadline)


CURRENT: ContextVar[RequestContext | None] = ContextVar("request", default=None)
"""The context of the gRPC call being handled: its door (service.frontends.grpc.interceptor) stamps it
in the call's task before the handler runs, as gRPC gives a handler no other way to receive it."""


class Inference(Generic[Result]):
    """One pipeline call inside the envelope: the pipeline's result, and its answer encoded by the front end."""

    __slots__ = ("_engine", "context", "result")

    def __init__(self, pipeline: Pipeline, context: RequestContext, result: Result) -> None:
        self._engine = pipeline
        self.context = context
        self.result = result

    async def encode(self, render: Callable[[], Encoded]) -> Encoded:
        """The answer in the front end's wire format: a small one on the event loop, a large one on a worker thread."""
        with tracing.stage(self.context.trace, "encode"):
            if _encodes_inline(self.result):
                return render()
            return await asyncio.to_thread(render)

    async def write(self, render: Callable[[], bytes]) -> bytes:
        """A tokenizer's answer, whose size is known only once written: written (as `encode`), then counted in flight.

        Refused (TooLarge, Overloaded) when its bytes do not fit the answer budget.
        """
        body = await self.encode(render)
        self._engine.hold_written(self.result, len(body), self.context.reservation)
        return body


def _encodes_inline(result: PipelineResult) -> bool:
    """Whether an answer is written on the event loop: a small one, or a tokenizer's whose texts were read there."""
    if isinstance(result, InferenceResult):
        return result.answer_bytes <= INLINE_ENCODE_BYTES
    return result.encode_inline


class _CountedInference(Generic[Result]):
    """The async context manager `Envelope.inference` returns: runs the request on entry, counts it on exit."""

    __slots__ = ("_context", "_engine", "_request", "_tracked")

    def __init__(self, pipeline: Pipeline, context: RequestContext, request: PipelineRequest) -> None:
        self._engine = pipeline
        self._context = context
        self._request = request
        tenant = context.tenant
        model_metrics, statistics = pipeline.counters(request.model, request.version)
        self._tracked = metrics.TrackedRequest(
            model_metrics, statistics, context.deadline, context.received, None if tenant is None else tenant.metrics
        )

    async def __aenter__(self) -> Inference[Result]:
        tracked = self._tracked.__enter__()
        context = self._context
        try:
            if context.tenant is not None:
                context.tenant.admit()
            result = await self._run()
            if isinstance(result, InferenceResult):
                tracked.inferred(result.rows, result.queue_s, result.compute_s)
            else:
                tracked.inferred(result.rows, 0.0, 0.0)  # the tokenizer's work alone: no queue, no model
            if context.tenant is not None:
                context.tenant.charge(result.prompt_tokens)
        except BaseException as error:
            tracked.__exit__(type(error), error, None)
            raise
        return Inference(self._engine, context, result)

    async def _run(self) -> Result:
        """The pipeline's one call for this request."""
        request, context = self._request, self._context
        if isinstance(request, TokenizeRequest):
            return await self._engine.tokenize(request)
        if isinstance(request, DecodeRequest):
            return await self._engine.decode(request)
        return await self._engine.infer(request, context.reservation, context.deadline, context.trace, context.tenant)

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None, traceback: object) -> None:
        self._tracked.__exit__(kind, error, traceback)


class Envelope:
    """Spans, authentication, admission, counting, the answer budget and failures: once, for every protocol."""

    def __init__(self, pipeline: Pipeline, api_keys: ApiKeys | None) -> None:
        self.pipeline = pipeline
        self.api_keys = api_keys

    @staticmethod
    def open(context: RequestContext, span: tracing.RequestSpan | None) -> None:
        """Start the request's span (None: not traced), the child of its caller's; `close` ends it."""
        context.trace = tracing.start(span)

    @staticmethod
    def open_stream(context: RequestContext, span: tracing.RequestSpan | None) -> None:
        """A stream: its span read once, for its messages (`message`); the stream itself has none."""
        context.span = span

    @staticmethod
    def message(stream: RequestContext, deadline: float | None) -> RequestContext:
        """One message of a stream, received now: the stream's tenant, and its span in the stream's caller's trace."""
        return RequestContext(time.perf_counter(), deadline, tracing.start(stream.span), stream.tenant)

    def authenticate(self, context: RequestContext, authorization: str | None, how: str) -> None:
        """Accept the request's `authorization` (Bearer key) and note its tenant, or refuse it (Unauthenticated).

        Nothing is checked while API keys are off. `how`: how this protocol sends a key, for the refusal.
        """
        if self.api_keys is None:
            return
        tenant = self.api_keys.tenant(authorization)
        if tenant is None:
            raise Unauthenticated(f"missing or unknown API key: {how}", "unauthenticated")
        context.tenant = tenant

    @staticmethod
    def decode(context: RequestContext, parse: Callable[[], Decoded]) -> Decoded:
        """The front end's reading of its request into the engine's types (the request's decode stage, when traced)."""
        with tracing.stage(context.trace, "decode"):
            return parse()

    @overload
    def inference(self, context: RequestContext, request: InferenceRequest) -> _CountedInference[InferenceResult]: ...
    @overload
    def inference(self, context: RequestContext, request: TokenizeRequest) -> _CountedInference[TokenizeResult]: ...
    @overload
    def inference(self, context: RequestContext, request: DecodeRequest) -> _CountedInference[DecodeResult]: ...
    def inference(self, context: RequestContext, request: PipelineRequest) -> _CountedInference:
        """Run one request as an async context manager: `async with envelope.inference(...) as inference:`.

        On entry the tenant is admitted (or refused), the pipeline runs the request (an inference, or
        a tokenize or decode, which run no model) and the tenant is charged its tokens; inside, the
        front end reads `inference.result` and renders its answer with `inference.encode` (a
        tokenizer's answer with `inference.write`); on exit the request is counted, a success only if
        nothing failed up to there.
        """
        if context.trace is not None:
            context.trace.describe(request.model, request.version)
        if context.reservation is None:
            context.reservation = self.pipeline.reservation()
            if context.closed:  # its client left before it ran: nothing may be held for it
                context.reservation.release()
        return _CountedInference(self.pipeline, context, request)

    @staticmethod
    def close(context: RequestContext, status: int, error: BaseException | None = None) -> None:
        """The request ended: its transport took the answer, or never will. Once, whatever the outcome.

        Its answer's bytes leave the budget, and its span ends with `status`, its protocol's (ERROR
        as the protocol counts one), and `error`, what it ended with, if anything.
        """
        if context.closed:
            return
        context.closed = True
        if context.reservation is not None:
            context.reservation.release()
        if context.trace is not None:
            context.trace.end(status, error)

    @staticmethod
    def failed(error: BaseException, where: str, peer: str = "") -> ServiceError:
        """The error a request ends with: a refusal at a limit counted by its reason; anything unplanned logged.

        `where`: what was being answered, and `peer` for whom (the transport's address), for the log.
        Returns the ServiceError to map to the protocol's status.
        """
        if isinstance(error, ServiceError):
            if error.reason is not None:
                metrics.REJECTED.labels(error.reason).inc()
            return error
        log.error("unhandled error answering %s for %s", where, peer or "an unknown peer", exc_info=error)
        return ServiceError(INTERNAL_MESSAGE)
