"""The one door of every RPC: API keys checked, then typed errors mapped to gRPC statuses."""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from service.errors import InvalidArgument, ServiceError, Unauthenticated
from service.ops import metrics, tenants
from service.ops.security import ApiKeys

log = logging.getLogger(__name__)

Behaviour = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
StreamBehaviour = Callable[[AsyncIterator[Any], grpc.aio.ServicerContext], AsyncIterator[Any]]
Deserializer = Callable[[bytes], Any] | None
PROTECTED_PREFIX = "/inference.GRPCInferenceService/"
"""Methods that need an API key when keys are configured (health and reflection stay open)."""
UNAUTHENTICATED_MESSAGE = "missing or unknown API key: send metadata 'authorization: Bearer <key>'"
INTERNAL_MESSAGE = "internal error; see the server log"


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
    """End the call with the error's status: a ServiceError's own, INTERNAL (logged) for anything else."""
    if isinstance(error, ServiceError):
        await context.abort(error.code, str(error))
    log.error("unhandled error in %s", getattr(behaviour, "__qualname__", behaviour), exc_info=error)
    await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)


def _abort_on_error(behaviour: Behaviour, deserializer: Deserializer) -> Behaviour:
    """The handler, taking the raw request bytes: parsing and every failure end in a precise status."""

    async def guarded(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behaviour(_parsed(raw, deserializer), context)
        except grpc.aio.AbortError:
            raise
        except Exception as error:
            await _abort_with_status(error, behaviour, context)
        return None  # unreachable: abort raises

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


async def _deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
    metrics.REJECTED.labels("unauthenticated").inc()
    await context.abort(Unauthenticated.code, UNAUTHENTICATED_MESSAGE)


def _denying(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED without reading the request."""
    serializers = {"request_deserializer": None, "response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(_deny, **serializers)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(_deny, **serializers)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(_deny, **serializers)
    return grpc.stream_stream_rpc_method_handler(_deny, **serializers)


def _authorization(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            return value if isinstance(value, str) else value.decode("latin-1")
    return None


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """The one door of every RPC: checks the API key (when keys are set), then maps errors to statuses.

    ServiceError (and anything unexpected) becomes a gRPC status for every unary method, every
    server stream written with context.write (health's Watch) and every asynchronous bidirectional
    stream (ModelStreamInfer), whose handlers take raw bytes and get their messages parsed here; a
    protected method called without an accepted key gets UNAUTHENTICATED before its handler runs.
    """

    def __init__(self, api_keys: ApiKeys | None = None) -> None:
        self._api_keys = api_keys
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
            wrapped = handler
            if handler.unary_unary is not None:
                wrapped = grpc.unary_unary_rpc_method_handler(
                    _abort_on_error(handler.unary_unary, handler.request_deserializer),
                    request_deserializer=None,
                    response_serializer=handler.response_serializer,
                )
            elif handler.unary_stream is not None and inspect.iscoroutinefunction(handler.unary_stream):
                # A server stream written with context.write (health's Watch): parsed and mapped like a unary call.
                wrapped = grpc.unary_stream_rpc_method_handler(
                    _abort_on_error(handler.unary_stream, handler.request_deserializer),
                    request_deserializer=None,
                    response_serializer=handler.response_serializer,
                )
            elif handler.stream_stream is not None and inspect.isasyncgenfunction(handler.stream_stream):
                wrapped = grpc.stream_stream_rpc_method_handler(
                    _abort_stream_on_error(handler.stream_stream, handler.request_deserializer),
                    request_deserializer=None,
                    response_serializer=handler.response_serializer,
                )
            denied = _denying(handler) if method.startswith(PROTECTED_PREFIX) else None
            cached = self._wrapped[method] = (wrapped, denied)
        wrapped, denied = cached
        if denied is not None and self._api_keys is not None:
            tenant = self._api_keys.tenant(_authorization(handler_call_details.invocation_metadata))
            if tenant is None:
                return denied
            # grpc.aio runs the interceptor and then the handler in the call's one task: the engine reads it there.
            tenants.CURRENT.set(tenant)
        return wrapped
