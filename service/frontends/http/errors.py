"""The HTTP status and error body of every typed error: the HTTP front end's one table."""

from __future__ import annotations

from enum import Enum

from service.errors import InvalidArgument, Kind, ServiceError


class Dialect(Enum):
    """The error body a route answers in: its API family's own, so that family's clients read it."""

    OPENAI = "openai"
    """{"error": {"message", "type", "param", "code"}}, as OpenAI's SDKs read it."""
    COHERE = "cohere"
    """{"message"}, as Cohere's v2 API answers (its SDK raises by status and shows the body)."""
    TEI = "tei"
    """{"error", "error_type"}, with text-embeddings-inference's statuses (422 for a wrong request, 424 Backend)."""
    KSERVE = "kserve"
    """{"error"}, as KServe v2 REST and tritonclient.http read it."""


class MethodNotAllowed(InvalidArgument):
    """A known path asked with a method it does not serve (HTTP's own refusal: 405)."""

    def __init__(self, message: str, allowed: tuple[str, ...]) -> None:
        super().__init__(message)
        self.allowed = allowed


class UnsupportedMediaType(InvalidArgument):
    """A body of a content type or encoding the route does not read (HTTP's own refusal: 415)."""


STATUS: dict[Kind, int] = {
    Kind.INVALID: 400,
    Kind.REQUEST_TOO_LARGE: 413,
    Kind.ANSWER_TOO_LARGE: 413,
    Kind.UNAUTHENTICATED: 401,
    Kind.NOT_FOUND: 404,
    Kind.OVERLOADED: 429,
    Kind.UNAVAILABLE: 503,
    Kind.DEADLINE_EXCEEDED: 504,
    Kind.UNIMPLEMENTED: 501,
    Kind.INTERNAL: 500,
}
"""Each kind's HTTP status; a route family's dialect may answer another (`tei_status`)."""


_OPENAI_TYPES = {401: "authentication_error", 429: "rate_limit_error"}
"""OpenAI's error `type` where it is not invalid_request_error (4xx) or server_error (5xx)."""


def http_status(error: ServiceError) -> int:
    """The HTTP status an error is answered with."""
    if isinstance(error, MethodNotAllowed):
        return 405
    if isinstance(error, UnsupportedMediaType):
        return 415
    return STATUS[error.kind]


def error_answer(dialect: Dialect, error: ServiceError) -> tuple[int, dict[str, object]]:
    """The status and body an error is answered with on a route of this dialect."""
    status, message = http_status(error), str(error)
    if dialect is Dialect.OPENAI:
        return status, openai_error(status, message, error.reason)
    if dialect is Dialect.COHERE:
        return status, cohere_error(message)
    if dialect is Dialect.TEI:
        status = tei_status(status)
        return status, tei_error(status, message)
    return status, kserve_error(message)


def openai_error(status: int, message: str, reason: str | None) -> dict[str, object]:
    """An OpenAI error object: the SDKs raise their exception class by status and show `message`."""
    kind = _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": reason}}


_TEI_TYPES = {
    401: "Unauthorized",
    413: "Validation",
    422: "Validation",
    424: "Backend",
    429: "Overloaded",
    503: "Unhealthy",
}
"""text-embeddings-inference's error_type by status (others: Backend for 5xx, Validation for 4xx)."""
_TEI_STATUSES = {400: 422, 500: 424}
"""Where TEI's routes answer another status than the others: a wrong request 422, a model failure 424 (Backend)."""


def tei_status(status: int) -> int:
    """The status a text-embeddings-inference route answers where the others answer `status`."""
    return _TEI_STATUSES.get(status, status)


def tei_error(status: int, message: str) -> dict[str, object]:
    """A text-embeddings-inference error body: its clients read `error` and `error_type`."""
    kind = _TEI_TYPES.get(status, "Backend" if status >= 500 else "Validation")
    return {"error": message, "error_type": kind}


def cohere_error(message: str) -> dict[str, object]:
    """A Cohere error body (its clients raise their error class by status and show `message`)."""
    return {"message": message}


def kserve_error(message: str) -> dict[str, object]:
    """A KServe v2 REST error (tritonclient.http raises it as InferenceServerException)."""
    return {"error": message}
