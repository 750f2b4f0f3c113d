"""The gRPC port's door: every call's request context stamped, its API key checked, its errors mapped to statuses.

What happens at the door is the envelope's (service.envelope); this module adapts it to grpc.aio's
interceptor and handler shapes, and maps error kinds through the port's one table (status.py). A
unary call ends in its envelope here: once the transport took its answer, or when it fails.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from protocol.retry_hint import RETRY_AFTER_METADATA
from service import envelope
from service.envelope import Envelope, RequestContext
from service.errors import InvalidArgument, Overloaded, Unauthenticated
from service.frontends.grpc import status
from service.ops import tracing

Behaviour = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
StreamBehaviour = Callable[[AsyncIterator[Any], grpc.aio.ServicerContext], AsyncIterator[Any]]
Deserializer = Callable[[bytes], Any] | None
PROTECTED_PREFIX = "/inference.GRPCInferenceService/"
"""Methods that need an API key when keys are configured (health and reflection stay open)."""
SEND_KEY = "send metadata 'authorization: Bearer <key>'"
"""How a gRPC caller sends its API key (the end of the refusal's message)."""
TRACED_CALLS = ("ModelInfer",)
"""Methods whose calls each get a span."""
TRACED_STREAMS = ("ModelStreamInfer",)
"""Streaming methods whose messages each get a span."""


def _parsed(raw: bytes, deserializer: Deserializer) -> Any:
    """The method's message from its bytes; bytes that are not one raise InvalidArgument.

    grpc's own deserialisation failure would surface as UNKNOWN, so handlers take raw bytes and
    messages are parsed here.
    """
    try:
        return deserializer(raw) if deserializer is not None else raw
    except DecodeError as error:
        raise InvalidArgument(f"the request is not a valid message for this method: {error}") from error


async def _abort_with_status(error: Exception, behaviour: object, context: grpc.aio.ServicerContext) -> None:
    """End the call with the status of the error it ends with (Envelope.failed: counted, or logged as INTERNAL)."""
    failure = Envelope.failed(error, getattr(behaviour, "__qualname__", str(behaviour)), context.peer())
    if isinstance(failure, Overloaded) and failure.retry_after_s is not None:  # as HTTP's Retry-After
        context.set_trailing_metadata(((RETRY_AFTER_METADATA, str(failure.retry_after_s)),))
    await context.abort(status.status_of(failure), str(failure))


def _abort_on_error(door: Envelope, behaviour: Behaviour, deserializer: Deserializer) -> Behaviour:
    """The handler, taking the raw request bytes: parsing and every failure end in a precise status.

    The call ends in its envelope when it fails, or once the transport took its answer.
    """

    async def guarded(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        request = envelope.CURRENT.get()
        try:
            answer = await behaviour(_parsed(raw, deserializer), context)
        except grpc.aio.AbortError:
            raise
        except BaseException as error:
            status.close(door, request, error)  # nothing will be sent
            if not isinstance(error, Exception):
                raise
            await _abort_with_status(error, behaviour, context)
            return None  # unreachable: abort raises
        if request.trace is not None or request.reservation is not None:
            context.add_done_callback(lambda _: status.close(door, request))
        return answer

    return guarded


class _ParsedMessages:
    """A stream's raw messages, each parsed as it is read.

    One that does not parse raises InvalidArgument, and the stream can still be read on: the
    handler decides whether that ends the call (then mapped here) or only answers that message.
    """

    def __init__(self, raw: AsyncIterator[bytes], deserializer: Deserializer) -> None:
        self._raw = aiter(raw)
        self._deserializer = deserializer

    def __aiter__(self) -> _ParsedMessages:
        return self

    async def __anext__(self) -> Any:
        return _parsed(await anext(self._raw), self._deserializer)


def _abort_stream_on_error(behaviour: StreamBehaviour, deserializer: Deserializer) -> StreamBehaviour:
    """A request-streaming handler (an async generator), taking raw messages: every failure ends in a precise status."""

    async def guarded(raw_requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async with aclosing(behaviour(_ParsedMessages(raw_requests, deserializer), context)) as responses:
                async for response in responses:
                    yield response
        except grpc.aio.AbortError:
            raise
        except Exception as error:
            await _abort_with_status(error, behaviour, context)

    return guarded


def _denying(handler: grpc.RpcMethodHandler, refusal: Unauthenticated) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that answers `refusal` without reading the request."""

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _abort_with_status(refusal, "an unauthenticated call", context)

    serializers = {"request_deserializer": None, "response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(deny, **serializers)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(deny, **serializers)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(deny, **serializers)
    return grpc.stream_stream_rpc_method_handler(deny, **serializers)


def _authorization(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            return value if isinstance(value, str) else value.decode("latin-1")
    return None


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """The door of every RPC: stamps the call's request context, checks its API key, maps its errors to statuses.

    The context (service.envelope.RequestContext) is stamped when the call arrives, in the call's task,
    where the handler reads it (envelope.CURRENT). ServiceError (and anything unexpected) becomes a gRPC
    status for every unary method, every server stream written with context.write (health's Watch) and
    every asynchronous bidirectional stream (ModelStreamInfer), whose handlers take raw bytes and get
    their messages parsed here; a protected method called without an accepted key gets UNAUTHENTICATED
    before its handler runs.
    """

    def __init__(self, door: Envelope) -> None:
        self._envelope = door
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler | None]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        """Wrap the method's handler once and reuse the wrapper for later calls."""
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is None:
            handler = await continuation(handler_call_details)
            if handler is None:
                return handler
            protected = handler if method.startswith(PROTECTED_PREFIX) else None
            cached = self._wrapped[method] = (_guarded(self._envelope, handler), protected)
        wrapped, protected = cached
        # grpc.aio runs the interceptor and then the handler in the call's one task: the handler reads it there.
        context = envelope.stamp()
        envelope.CURRENT.set(context)
        if protected is not None:
            metadata = handler_call_details.invocation_metadata
            try:
                self._envelope.authenticate(context, _authorization(metadata), SEND_KEY)
            except Unauthenticated as refusal:
                return _denying(protected, refusal)
            self._open(context, method[len(PROTECTED_PREFIX) :], metadata)
        return wrapped

    def _open(self, context: RequestContext, name: str, metadata: Sequence[tuple[str, str | bytes]] | None) -> None:
        """Open a traced call's span in its envelope, or read its stream's once for its messages."""
        if name in TRACED_CALLS:
            self._envelope.open(context, tracing.rpc_span(name, metadata))
        elif name in TRACED_STREAMS:
            self._envelope.open_stream(context, tracing.rpc_span(name, metadata))


def _guarded(door: Envelope, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """The handler taking raw bytes, its failures mapped to statuses (as it is for kinds grpc.aio cannot wrap)."""
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(
            _abort_on_error(door, handler.unary_unary, handler.request_deserializer),
            request_deserializer=None,
            response_serializer=handler.response_serializer,
        )
    if handler.unary_stream is not None and inspect.iscoroutinefunction(handler.unary_stream):
        # A server stream written with context.write (health's Watch): parsed and mapped like a unary call.
        return grpc.unary_stream_rpc_method_handler(
            _abort_on_error(door, handler.unary_stream, handler.request_deserializer),
            request_deserializer=None,
            response_serializer=handler.response_serializer,
        )
    if handler.stream_stream is not None and inspect.isasyncgenfunction(handler.stream_stream):
        return grpc.stream_stream_rpc_method_handler(
            _abort_stream_on_error(handler.stream_stream, handler.request_deserializer),
            request_deserializer=None,
            response_serializer=handler.response_serializer,
        )
    return handler
