"""Typed request errors of a few protocol-neutral kinds; each protocol maps kinds to its statuses in one table.

The core and the pipeline raise these and know no wire: the gRPC port's table is
service.frontends.grpc.status, the HTTP port's service.frontends.http.errors. A request is counted
(encoder_requests_total, Triton's statistics, traces) by its outcome, named as the KServe v2 / Triton
protocol names statuses (gRPC's code names): `outcome` gives it.
"""

from __future__ import annotations

import asyncio
import enum
import time

DEADLINE_CLOCK_SLACK_S = 0.05
"""gRPC cancels a call at its deadline by its own clock, which differs by milliseconds from the deadline
the server derives from `time_remaining()` (docs/decisions.md#deadline-clock-slack). A caller that
goes away this close to its deadline, or after it, is counted as expired, not cancelled."""

INTERNAL_MESSAGE = "internal error; see the server log"
"""What a caller is told of a failure nobody planned for (the log has the traceback)."""


class Kind(enum.Enum):
    """What kind of refusal or failure an error is: the one thing a protocol's status table reads.

    Each member is (its own name, the outcome a request refused so is counted under: the protocol's
    status name, which several kinds may share).
    """

    INVALID = ("invalid", "INVALID_ARGUMENT")
    """The request itself is wrong (inputs, shapes, contents, values)."""
    REQUEST_TOO_LARGE = ("request_too_large", "INVALID_ARGUMENT")
    """The request carries more than a limit allows (a body, a text, the texts together, inputs)."""
    ANSWER_TOO_LARGE = ("answer_too_large", "RESOURCE_EXHAUSTED")
    """The answer asked for would be larger than the server sends in one response."""
    NOT_FOUND = ("not_found", "NOT_FOUND")
    OVERLOADED = ("overloaded", "RESOURCE_EXHAUSTED")
    UNAVAILABLE = ("unavailable", "UNAVAILABLE")
    DEADLINE_EXCEEDED = ("deadline_exceeded", "DEADLINE_EXCEEDED")
    UNAUTHENTICATED = ("unauthenticated", "UNAUTHENTICATED")
    UNIMPLEMENTED = ("unimplemented", "UNIMPLEMENTED")
    INTERNAL = ("internal", "INTERNAL")

    def __init__(self, _name: str, outcome: str) -> None:
        self.outcome = outcome


class ServiceError(Exception):
    """A request that cannot be answered; subclasses fix its kind.

    `reason` names the limit or check that refused it, for `encoder_requests_rejected_total`.
    """

    kind = Kind.INTERNAL

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason


class InvalidArgument(ServiceError):
    """The request itself is wrong (inputs, shapes, contents, values)."""

    kind = Kind.INVALID


class RequestTooLarge(InvalidArgument):
    """The request carries more than a limit allows: its body, a text, its texts together, its inputs."""

    kind = Kind.REQUEST_TOO_LARGE


class NotFound(ServiceError):
    """Unknown model or version."""

    kind = Kind.NOT_FOUND


class Overloaded(ServiceError):
    """The queue is full: rejected at once rather than queued without bound."""

    kind = Kind.OVERLOADED

    def __init__(self, message: str, reason: str | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(message, reason)
        self.retry_after_s = retry_after_s
        """Whole seconds until a retry may be let in (HTTP's Retry-After, gRPC's retry-after), where known."""


class OverLimit(Overloaded):
    """A tenant over one of its limits (service.ops.tenants): refused until its bucket has refilled."""

    def __init__(self, message: str, reason: str, retry_after_s: int) -> None:
        super().__init__(message, reason, retry_after_s)


class TooLarge(ServiceError):
    """The answer asked for is larger than the server sends in one response: refused before running."""

    kind = Kind.ANSWER_TOO_LARGE


class Unavailable(ServiceError):
    """Not ready yet, or draining for shutdown."""

    kind = Kind.UNAVAILABLE


class DeadlineExceeded(ServiceError):
    """The request's timeout passed before it could be run."""

    kind = Kind.DEADLINE_EXCEEDED


class Unauthenticated(ServiceError):
    """No accepted API key in the request's `authorization: Bearer <key>` metadata."""

    kind = Kind.UNAUTHENTICATED


class Unimplemented(ServiceError):
    """A method of Triton's protocol that this server declares but does not offer."""

    kind = Kind.UNIMPLEMENTED


class ModelFailure(ServiceError):
    """Running the model failed; only the requests of that batch get this."""

    kind = Kind.INTERNAL


class ExecutionError(RuntimeError):
    """At start: a model instance that cannot run as configured; the message says why, in one line (exit 2)."""


def past_deadline(deadline: float | None) -> bool:
    """Whether a monotonic deadline has passed, within gRPC's clock slack (never, for no deadline)."""
    return deadline is not None and deadline - DEADLINE_CLOCK_SLACK_S <= time.monotonic()


def outcome(error: BaseException | None, deadline: float | None = None) -> str:
    """The outcome a request is counted under: OK, its kind's, CANCELLED, DEADLINE_EXCEEDED or INTERNAL.

    A cancellation at the caller's deadline is DEADLINE_EXCEEDED, as the caller sees it.
    """
    if error is None:
        return "OK"
    if isinstance(error, ServiceError):
        return error.kind.outcome
    if isinstance(error, asyncio.CancelledError):
        return "DEADLINE_EXCEEDED" if past_deadline(deadline) else "CANCELLED"
    return "INTERNAL"
