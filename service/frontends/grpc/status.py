"""The gRPC status of every kind of error and of every outcome: the gRPC port's one table."""

from __future__ import annotations

import grpc

from service.errors import Kind, ServiceError, outcome

STATUS: dict[Kind, grpc.StatusCode] = {
    Kind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    Kind.REQUEST_TOO_LARGE: grpc.StatusCode.INVALID_ARGUMENT,
    Kind.ANSWER_TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Kind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Kind.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Kind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Kind.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    Kind.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    Kind.UNIMPLEMENTED: grpc.StatusCode.UNIMPLEMENTED,
    Kind.INTERNAL: grpc.StatusCode.INTERNAL,
}
"""Each kind's status; a request refused with a kind is counted under the same name (Kind.outcome)."""


def status_of(error: ServiceError) -> grpc.StatusCode:
    """The status a call ending with `error` is answered with."""
    return STATUS[error.kind]


def outcome_status(error: BaseException | None, deadline: float | None) -> grpc.StatusCode:
    """The status of a request that ended with `error` (None: OK), a cancellation at its deadline DEADLINE_EXCEEDED."""
    if isinstance(error, ServiceError):
        return status_of(error)
    return grpc.StatusCode[outcome(error, deadline)]  # OK, CANCELLED, DEADLINE_EXCEEDED or INTERNAL


def status_number(error: BaseException | None, deadline: float | None) -> int:
    """The number of `outcome_status` (a span's rpc.grpc.status_code): the gRPC port's table as the envelope asks it."""
    return outcome_status(error, deadline).value[0]
