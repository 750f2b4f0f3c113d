"""The gRPC port's door: a protected call enters its envelope once, here; its errors are mapped to statuses.

What happens at the door is the envelope's (service.envelope): the call's envelope opened (stamped,
its span started, its API key checked) as its handler starts, in the call's task. This module adapts
it to grpc.aio's interceptor and handler shapes, and maps error kinds through the port's one table
(status.py), which the envelope also asks for the status a span ends with. A unary call's envelope
ends here: once the transport took its answer, or when it fails.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from protocol.retry_hint import RETRY_AFTER_METADATA
from service import envelope
from service.envelope import Envelope, RequestEnvelope
from service.errors import InvalidArgument, Overloaded
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
    """End the call with the status of the error it ends with (envelope.failed: counted, or logged as INTERNAL)."""
    failure = envelope.failed(error, getattr(behaviour, "__qualname__", str(behaviour)), context.peer())
    if isinstance(failure, Overloaded) and failure.retry_after_s is not None:  # as HTTP's Retry-After
        context.set_trailing_metadata(((RETRY_AFTER_METADATA, str(failure.retry_after_s)),))
    await context.abort(status.status_of(failure), str(failure))


def _open(door: Envelope, method: str, context: grpc.aio.ServicerContext) -> RequestEnvelope:
    """A protected call's envelope, opened in the call's task for its handler (envelope.CURRENT), or Unauthenticated.

    A traced call gets its span, a traced stream its messages' (each message's envelope opens from
    the stream's); its deadline is the transport's (grpc-timeout).
    """
    metadata = context.invocation_metadata()
    remaining = context.time_remaining()
    opened = door.request(
        tracing.rpc_span(method, metadata) if method in TRACED_CALLS or method in TRACED_STREAMS else None,
        status.status_number,
        authorization=_authorization(metadata),
        send_key=SEND_KEY,
        deadline=None if remaining is None else time.monotonic() + remaining,
        stream=method in TRACED_STREAMS,
    )
    envelope.CURRENT.set(opened)
    return opened


def _abort_on_error(door: Envelope, behaviour: Behaviour, deserializer: Deserializer, method: str | None) -> Behaviour:
    """The handler, taking the raw request bytes: parsing and every failure end in a precise status.

    A protected `method` (None: an open one) runs in its envelope, which ends when the call fails,
    or once the transport took its answer.
    """

    async def guarded(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        request = None
        try:
            if method is not None:
                request = _open(door, method, context)
            answer = await behaviour(_parsed(raw, deserializer), context)
        except BaseException as error:
            if request is not None:
                request.end(error)  # nothing will be sent
            if not isinstance(error, Exception) or isinstance(error, grpc.aio.AbortError):
                raise
            await _abort_with_status(error, behaviour, context)
            return None  # unreachable: abort raises
        if request is not None and request.holding:
            context.add_done_callback(lambda _: request.end())
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


def _abort_stream_on_error(
    door: Envelope, behaviour: StreamBehaviour, deserializer: Deserializer, method: str | None
) -> StreamBehaviour:
    """A request-streaming handler (an async generator), taking raw messages: every failure ends in a precise status.

    A protected `method` (None: an open one) runs in its envelope, ended with the stream.
    """

    async def guarded(raw_requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        request = None
        ended_with: BaseException | None = None
        try:
            if method is not None:
                request = _open(door, method, context)
            async with aclosing(behaviour(_ParsedMessages(raw_requests, deserializer), context)) as responses:
                async for response in responses:
                    yield response
        except grpc.aio.AbortError:
            raise
        except Exception as error:
            ended_with = error
            await _abort_with_status(error, behaviour, context)
        finally:
            if request is not None:
                request.end(ended_with)

    return guarded


def _authorization(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            return value if isinstance(value, str) else value.decode("latin-1")
    return None


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """The door of every RPC: a protected call's envelope opened (its key checked), its errors mapped to statuses.

    A protected method's call enters the envelope (service.envelope) once, as it arrives, in the
    call's task, where its handler reads it (envelope.CURRENT), and is refused UNAUTHENTICATED there
    before its handler runs when keys are on and its key is not accepted; health and reflection stay
    open. ServiceError (and anything unexpected) becomes a gRPC status for every unary method, every
    server stream written with context.write (health's Watch) and every asynchronous bidirectional
    stream (ModelStreamInfer), whose handlers take raw bytes and get their messages parsed here.
    """

    def __init__(self, door: Envelope) -> None:
        self._envelope = door
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        """Wrap the method's handler once and reuse the wrapper for later calls."""
        method = handler_call_details.method
        wrapped = self._wrapped.get(method)
        if wrapped is None:
            handler = await continuation(handler_call_details)
            if handler is None:
                return handler
            protected = method[len(PROTECTED_PREFIX) :] if method.startswith(PROTECTED_PREFIX) else None
            wrapped = self._wrapped[method] = _guarded(self._envelope, handler, protected)
        return wrapped


def _guarded(door: Envelope, handler: grpc.RpcMethodHandler, protected: str | None) -> grpc.RpcMethodHandler:
    """The handler taking raw bytes, its failures mapped to statuses (as it is for kinds grpc.aio cannot wrap).

    `protected`: the method's name when its calls run in an envelope (and need a key), else None.
    """
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(
            _abort_on_error(door, handler.unary_unary, handler.request_deserializer, protected),
            request_deserializer=None,
            response_serializer=handler.response_serializer,
        )
    if handler.unary_stream is not None and inspect.iscoroutinefunction(handler.unary_stream):
        # A server stream written with context.write (health's Watch): parsed and mapped like a unary call.
        return grpc.unary_stream_rpc_method_handler(
            _abort_on_error(door, handler.unary_stream, handler.request_deserializer, protected),
            request_deserializer=None,
            response_serializer=handler.response_serializer,
        )
    if handler.stream_stream is not None and inspect.isasyncgenfunction(handler.stream_stream):
        return grpc.stream_stream_rpc_method_handler(
            _abort_stream_on_error(door, handler.stream_stream, handler.request_deserializer, protected),
            request_deserializer=None,
            response_serializer=handler.response_serializer,
        )
    if protected is not None:
        raise TypeError(f"{protected}: a protected method is unary or an asynchronous bidirectional stream")
    return handler
