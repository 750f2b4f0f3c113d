"""Typed request errors and their gRPC status, mapped in exactly one place."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

log = logging.getLogger(__name__)


class ServiceError(Exception):
    """A request that cannot be answered; subclasses fix the gRPC status."""

    code = grpc.StatusCode.UNKNOWN


class InvalidArgument(ServiceError):
    """The request itself is wrong (inputs, shapes, contents, values)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ServiceError):
    """Unknown model or version."""

    code = grpc.StatusCode.NOT_FOUND


class Overloaded(ServiceError):
    """The queue is full: rejected at once rather than queued without bound."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    """Not ready yet, or draining for shutdown."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(ServiceError):
    """The request's timeout passed before it could be run."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class ModelFailure(ServiceError):
    """Running the model failed; only the requests of that batch get this."""

    code = grpc.StatusCode.INTERNAL


def status_of(error: BaseException | None) -> grpc.StatusCode:
    """The gRPC status an outcome is reported with (None is success)."""
    if error is None:
        return grpc.StatusCode.OK
    if isinstance(error, ServiceError):
        return error.code
    if isinstance(error, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.INTERNAL


Behaviour = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]


def _abort_on_error(behaviour: Behaviour) -> Behaviour:
    async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
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


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Turns ServiceError (and anything unexpected) into a gRPC status, for every unary method."""

    def __init__(self) -> None:
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        """Wrap the method's handler once and reuse the wrapper for later calls."""
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is not None:
            return cached
        handler = await continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        wrapped = grpc.unary_unary_rpc_method_handler(
            _abort_on_error(handler.unary_unary),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
        self._wrapped[method] = wrapped
        return wrapped
