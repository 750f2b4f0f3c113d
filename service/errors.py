"""Typed request errors and the gRPC status of each (mapped to the wire in service.frontends.grpc.interceptor)."""

from __future__ import annotations

import asyncio
import time

import grpc

DEADLINE_CLOCK_SLACK_S = 0.05
"""gRPC cancels a call at its deadline by its own clock, which differs by milliseconds from the deadline
the server derives from `time_remaining()` (measured here: gRPC cancelled up to ~8 ms before it). A
caller that goes away this close to its deadline, or after it, is counted as expired, not cancelled."""


class ServiceError(Exception):
    """A request that cannot be answered; subclasses fix the gRPC status.

    `reason` names the limit or check that refused it, for `encoder_requests_rejected_total`.
    """

    code = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason


class InvalidArgument(ServiceError):
    """The request itself is wrong (inputs, shapes, contents, values)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ServiceError):
    """Unknown model or version."""

    code = grpc.StatusCode.NOT_FOUND


class Overloaded(ServiceError):
    """The queue is full: rejected at once rather than queued without bound."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class OverLimit(Overloaded):
    """A tenant over one of its limits (service.ops.tenants): refused until its bucket has refilled."""

    def __init__(self, message: str, reason: str, retry_after_s: int) -> None:
        super().__init__(message, reason)
        self.retry_after_s = retry_after_s
        """Whole seconds until the limit lets a request of the tenant in again (HTTP's Retry-After)."""


class TooLarge(ServiceError):
    """The answer asked for is larger than the server sends in one response: refused before running."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    """Not ready yet, or draining for shutdown."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(ServiceError):
    """The request's timeout passed before it could be run."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unauthenticated(ServiceError):
    """No accepted API key in the request's `authorization: Bearer <key>` metadata."""

    code = grpc.StatusCode.UNAUTHENTICATED


class Unimplemented(ServiceError):
    """A method of Triton's protocol that this server declares but does not offer."""

    code = grpc.StatusCode.UNIMPLEMENTED


class ModelFailure(ServiceError):
    """Running the model failed; only the requests of that batch get this."""

    code = grpc.StatusCode.INTERNAL


class ExecutionError(RuntimeError):
    """At start: a model instance that cannot run as configured; the message says why, in one line (exit 2)."""


def past_deadline(deadline: float | None) -> bool:
    """Whether a monotonic deadline has passed, within gRPC's clock slack (never, for no deadline)."""
    return deadline is not None and deadline - DEADLINE_CLOCK_SLACK_S <= time.monotonic()


def status_of(error: BaseException | None, deadline: float | None = None) -> grpc.StatusCode:
    """The gRPC status an outcome is reported with (None is success).

    A cancellation at the caller's deadline is DEADLINE_EXCEEDED, as the caller sees it.
    """
    if error is None:
        return grpc.StatusCode.OK
    if isinstance(error, ServiceError):
        return error.code
    if isinstance(error, asyncio.CancelledError):
        return grpc.StatusCode.DEADLINE_EXCEEDED if past_deadline(deadline) else grpc.StatusCode.CANCELLED
    return grpc.StatusCode.INTERNAL
