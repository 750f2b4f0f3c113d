"""The request envelope: what happens around every request, whatever its protocol, written once.

A front end enters it once per request, where the request arrives: `Envelope.request` opens the
request's `RequestEnvelope`, which owns its life from there:

- opened: stamped (when it was received, its deadline), its span started (a traced request; a
  stream's messages each get theirs, in the stream's caller's trace, from `message`), the front
  end's own first refusals made, its API key checked (its tenant, or Unauthenticated);
- `decode`: the front end's reading of its wire format (a stage of its span);
- `inference` (`inferences`: a request in parts, one a kind of input): the request's tenant admitted,
  its reservation in the answer budget made, the pipeline's one call (service.pipeline.api: `infer`,
  or `tokenize` and `decode`, which run no model), the tenant charged its tokens, the answer encoded,
  and the request counted once its answer is encoded (encoder_requests_total, Triton's statistics,
  the tenant's figures), from the moment it was received;
- `end`, once, when the transport has taken the answer or never will (answered, failed, client
  gone, cancelled): the reservation released, and the span ended with the status the protocol's
  one table gives what the request ended with.

`failed` is the error a request ends with: counted once in encoder_requests_rejected_total when it
is a refusal at a limit, an unplanned failure logged and turned into an internal error. A front end
only parses its wire format, renders answers and maps error kinds to its statuses
(service.frontends.grpc.status, service.frontends.http.errors).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Generic, TypeVar, overload

from service.errors import INTERNAL_MESSAGE, ServiceError, Unauthenticated, Unavailable
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


StatusOf = Callable[[BaseException | None, float | None], int]
"""A protocol's one table, as the envelope asks it: the status a request answered with, from what it ended with
(None: answered) and its deadline (a cancellation at it is DEADLINE_EXCEEDED); its span ends with that status."""


CURRENT: ContextVar[RequestEnvelope | None] = ContextVar("request", default=None)
"""The envelope of the gRPC call being handled: its door (service.frontends.grpc.interceptor) opens it in the
call's task before the handler runs, as gRPC gives a handler no other way to receive it."""


class Inference(Generic[Result]):
    """One pipeline call inside the envelope: the pipeline's result, and its answer encoded by the front end."""

    __slots__ = ("_engine", "_reservation", "_trace", "result")

    def __init__(
        self, pipeline: Pipeline, result: Result, reservation: Reservation, trace: tracing.RequestTrace | None
    ) -> None:
        self._engine = pipeline
        self._reservation = reservation
        self._trace = trace
        self.result = result

    async def encode(self, render: Callable[[], Encoded]) -> Encoded:
        """The answer in the front end's wire format: a small one on the event loop, a large one on a worker thread."""
        with tracing.stage(self._trace, "encode"):
            if _encodes_inline(self.result):
                return render()
            return await asyncio.to_thread(render)

    async def write(self, render: Callable[[], bytes]) -> bytes:
        """A tokenizer's answer, whose size is known only once written: written (as `encode`), then counted in flight.

        Refused (TooLarge, Overloaded) when its bytes do not fit the answer budget.
        """
        body = await self.encode(render)
        self._engine.hold_written(self.result, len(body), self._reservation)
        return body


def _encodes_inline(result: PipelineResult) -> bool:
    """Whether an answer is written on the event loop: a small one, or a tokenizer's whose texts were read there."""
    if isinstance(result, InferenceResult):
        return result.answer_bytes <= INLINE_ENCODE_BYTES
    return result.encode_inline


class _CountedInferences:
    """What `RequestEnvelope.inferences` returns: runs a request's parts on entry, counts the request once on exit.

    The parts of one request (a mixed request's texts and images: one pipeline call a kind) are one request to
    the caller: its tenant admitted once, charged the tokens of every part, and the request counted once, with
    the rows of every part and the time they spent queued and running.
    """

    __slots__ = ("_engine", "_envelope", "_requests", "_tracked")

    def __init__(self, envelope: RequestEnvelope, pipeline: Pipeline, requests: tuple[PipelineRequest, ...]) -> None:
        self._engine = pipeline
        self._envelope = envelope
        self._requests = requests
        tenant = envelope.tenant
        model_metrics, statistics = pipeline.counters(requests[0].model, requests[0].version)
        self._tracked = metrics.TrackedRequest(
            model_metrics, statistics, envelope.deadline, envelope.received, None if tenant is None else tenant.metrics
        )

    async def __aenter__(self) -> tuple[Inference, ...]:
        tracked = self._tracked.__enter__()
        tenant = self._envelope.tenant
        try:
            reservation = self._envelope._reserved()  # made with its first inference
            if tenant is not None:
                tenant.admit()
            results = [await self._run(request, reservation) for request in self._requests]
            inferred = [result for result in results if isinstance(result, InferenceResult)]
            # The tokenizer's work alone runs no queue and no model.
            queue_s = sum(result.queue_s for result in inferred)
            compute_s = sum(result.compute_s for result in inferred)
            tracked.inferred(sum(result.rows for result in results), queue_s, compute_s)
            if tenant is not None:
                tenant.charge(sum(result.prompt_tokens for result in results))
        except BaseException as error:
            tracked.__exit__(type(error), error, None)
            raise
        return tuple(Inference(self._engine, result, reservation, self._envelope.trace) for result in results)

    async def _run(self, request: PipelineRequest, reservation: Reservation) -> PipelineResult:
        """The pipeline's one call for one part of this request."""
        envelope = self._envelope
        if isinstance(request, TokenizeRequest):
            return await self._engine.tokenize(request)
        if isinstance(request, DecodeRequest):
            return await self._engine.decode(request)
        return await self._engine.infer(request, reservation, envelope.deadline, envelope.trace, envelope.tenant)

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None, traceback: object) -> None:
        self._tracked.__exit__(kind, error, traceback)


class _CountedInference(Generic[Result]):
    """The async context manager `RequestEnvelope.inference` returns: a request of one part (`_CountedInferences`)."""

    __slots__ = ("_parts",)

    def __init__(self, envelope: RequestEnvelope, pipeline: Pipeline, request: PipelineRequest) -> None:
        self._parts = _CountedInferences(envelope, pipeline, (request,))

    async def __aenter__(self) -> Inference[Result]:
        (inference,) = await self._parts.__aenter__()
        return inference

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None, traceback: object) -> None:
        await self._parts.__aexit__(kind, error, traceback)


class RequestEnvelope:
    """One request's envelope, from where it entered the server until its transport took the answer, or never will.

    Opened by `Envelope.request` (stamped, its span started, its key accepted); inside it the front
    end reads its request (`decode`) and runs it (`inference`); `end`, once, closes it. A stream's
    envelope opens one for each of its messages (`message`).
    """

    __slots__ = (
        "_ended",
        "_pipeline",
        "_reservation",
        "_status_of",
        "_stream_span",
        "deadline",
        "received",
        "tenant",
        "trace",
    )

    def __init__(
        self,
        pipeline: Pipeline,
        status_of: StatusOf,
        deadline: float | None,
        *,
        tenant: Tenant | None,
        trace: tracing.RequestTrace | None,
        stream_span: tracing.RequestSpan | None = None,
    ) -> None:
        self.received = time.perf_counter()
        """When it entered (time.perf_counter): its latency and Triton's statistics count from here."""
        self.deadline = deadline
        """The caller's deadline (time.monotonic), from the transport (gRPC's grpc-timeout), if any."""
        self.tenant = tenant
        """Its tenant, once its key was accepted (None while keys are off)."""
        self.trace = trace
        """Its span (while tracing is on and its route is traced); a stream's messages each have theirs."""
        self._pipeline = pipeline
        self._status_of = status_of
        self._stream_span = stream_span
        self._reservation: Reservation | None = None
        self._ended = False

    @property
    def holding(self) -> bool:
        """Whether it holds something until `end`: a span to end, or its answer's bytes in the budget."""
        return self.trace is not None or self._reservation is not None

    @property
    def pipeline(self) -> Pipeline:
        """The engine its inferences run on (and a front end reads models' facts from)."""
        return self._pipeline

    def message(self, deadline: float | None) -> RequestEnvelope:
        """One message of this stream, received now, in an envelope of its own: the stream's tenant, its own span.

        Its span is a child of the stream caller's; it ends, as any request's, with its own `end`.
        """
        return RequestEnvelope(
            self._pipeline, self._status_of, deadline, tenant=self.tenant, trace=tracing.start(self._stream_span)
        )

    def decode(self, parse: Callable[[], Decoded]) -> Decoded:
        """The front end's reading of its request into the engine's types (the request's decode stage, when traced)."""
        with tracing.stage(self.trace, "decode"):
            return parse()

    @overload
    def inference(self, request: InferenceRequest) -> _CountedInference[InferenceResult]: ...
    @overload
    def inference(self, request: TokenizeRequest) -> _CountedInference[TokenizeResult]: ...
    @overload
    def inference(self, request: DecodeRequest) -> _CountedInference[DecodeResult]: ...
    def inference(self, request: PipelineRequest) -> _CountedInference:
        """Run one request as an async context manager: `async with envelope.inference(request) as inference:`.

        On entry the tenant is admitted (or refused), the pipeline runs the request (an inference, or
        a tokenize or decode, which run no model) and the tenant is charged its tokens; inside, the
        front end reads `inference.result` and renders its answer with `inference.encode` (a
        tokenizer's answer with `inference.write`); on exit the request is counted, a success only if
        nothing failed up to there. Its answer's bytes stay in the budget until `end`.
        """
        if self.trace is not None:
            self.trace.describe(request.model, request.version)
        return _CountedInference(self, self._pipeline, request)

    def inferences(self, requests: Sequence[InferenceRequest]) -> _CountedInferences:
        """Run one request's parts in turn, as one request: `async with envelope.inferences(parts) as inferences:`.

        The parts: a mixed request's texts and images, one inference a kind, all of one model; one `Inference` a
        part comes back. As `inference`, but the tenant is admitted and charged once for them all, and the request
        counted once.
        """
        if self.trace is not None:
            self.trace.describe(requests[0].model, requests[0].version)
        return _CountedInferences(self, self._pipeline, tuple(requests))

    def _reserved(self) -> Reservation:
        """Its answer's place in the budget, made for its first inference and released by `end`, the only two places.

        Unavailable once it ended (its client left before it ran): nothing may be held for it.
        """
        if self._ended:
            raise Unavailable("the request ended before its answer was budgeted")
        if self._reservation is None:
            self._reservation = self._pipeline.reservation()
        return self._reservation

    def end(self, error: BaseException | None = None) -> None:
        """The request ended: its transport took the answer (`error` None), or never will. Once, whatever the outcome.

        Its answer's bytes leave the budget, and its span ends with the status its protocol answers
        `error` with (the protocol's one table, given when it was opened) and `error` itself.
        """
        if self._ended:
            return
        self._ended = True
        if self._reservation is not None:
            self._reservation.release()
        if self.trace is not None:
            self.trace.end(self._status_of(error, self.deadline), error)


class Envelope:
    """The door every request enters once, whatever its protocol: its envelope opened, over one pipeline."""

    def __init__(self, pipeline: Pipeline, api_keys: ApiKeys | None) -> None:
        self.pipeline = pipeline
        self.api_keys = api_keys

    def request(
        self,
        span: tracing.RequestSpan | None,
        status_of: StatusOf,
        *,
        authorization: str | None = None,
        send_key: str | None = None,
        deadline: float | None = None,
        stream: bool = False,
        refuse_first: Callable[[], None] | None = None,
    ) -> RequestEnvelope:
        """A request's envelope, opened as it arrives: stamped, its span started, then its key checked.

        `span`: what its span is (None: not traced); a stream's (`stream`) is its messages' (`message`),
        the stream itself has none. `status_of`: its protocol's status of an outcome, for the span.
        `refuse_first`: the front end's own refusals that come before the key (HTTP's routing, its
        concurrency limit). `authorization`: the Bearer key it sent, checked when keys are on and
        the route needs one: `send_key`, how this protocol sends a key (the refusal ends with it),
        None for a route open without a key. A refusal (Unauthenticated, or one of `refuse_first`'s)
        ends the envelope and is raised for the front end to answer.
        """
        if stream:
            opened = RequestEnvelope(self.pipeline, status_of, deadline, tenant=None, trace=None, stream_span=span)
        else:
            opened = RequestEnvelope(self.pipeline, status_of, deadline, tenant=None, trace=tracing.start(span))
        try:
            if refuse_first is not None:
                refuse_first()
            if send_key is not None and self.api_keys is not None:
                opened.tenant = self._tenant(authorization, send_key)
        except BaseException as refusal:
            opened.end(refusal)
            raise
        return opened

    def _tenant(self, authorization: str | None, send_key: str) -> Tenant:
        """The tenant of an accepted `authorization` (Bearer key), or Unauthenticated, saying how to send one."""
        tenant = self.api_keys.tenant(authorization)
        if tenant is None:
            raise Unauthenticated(f"missing or unknown API key: {send_key}", "unauthenticated")
        return tenant


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
