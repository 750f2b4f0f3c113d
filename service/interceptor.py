"""The one door of every RPC: API keys checked, then typed errors mapped to gRPC statuses."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from service import metrics
from service.errors import InvalidArgument, ServiceError, Unauthenticated
from service.security import ApiKeys

log = logging.getLogger(__name__)

Behaviour = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
PROTECTED_PREFIX = "/inference.GRPCInferenceService/"
"""Methods that need an API key when keys are configured (health and reflection stay open)."""
UNAUTHENTICATED_MESSAGE = "missing or unknown API key: send metadata 'authorization: Bearer <key>'"


def _abort_on_error(behaviour: Behaviour, deserializer: Callable[[bytes], Any] | None) -> Behaviour:
    """The handler, taking the raw request bytes: parsing and every failure end in a precise status.

    grpc's own deserialisation failure would surface as UNKNOWN before any handler runs, so the
    message is parsed here: bytes that are not the method's message get INVALID_ARGUMENT.
    """

    async def guarded(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            try:
                request = deserializer(raw) if deserializer is not None else raw
            except DecodeError as error:
                raise InvalidArgument(f"the request is not a valid message for this method: {error}") from error
            return await behaviour(request, context)
        except ServiceError as error:
            await context.abort(error.code, str(error))
        except grpc.aio.AbortError:
            raise
        except Exception:
            log.exception("unhandled error in %s", getattr(behaviour, "__qualname__", behaviour))
            await context.abort(grpc.StatusCode.INTERNAL, "internal error; see the server log")
        return None  # unreachable: abort raises

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

    ServiceError (and anything unexpected) becomes a gRPC status for every unary method; a
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
            denied = _denying(handler) if method.startswith(PROTECTED_PREFIX) else None
            cached = self._wrapped[method] = (wrapped, denied)
        wrapped, denied = cached
        if (
            denied is not None
            and self._api_keys is not None
            and not self._api_keys.accepts(_authorization(handler_call_details.invocation_metadata))
        ):
            return denied
        return wrapped
