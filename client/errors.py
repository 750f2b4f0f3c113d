"""Typed errors for what the server refuses or fails, each carrying the server's reason and status."""

from __future__ import annotations

import grpc

from protocol.retry_hint import RETRY_AFTER_METADATA


class EmbeddingError(Exception):
    """The server refused or failed a request; `code` is the gRPC status, `message` the server's reason."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s
        """The server's hint: seconds before the same request may succeed (a tenant's limit), or None."""


class InvalidRequest(EmbeddingError):
    """INVALID_ARGUMENT: the request itself is wrong (a text, an option, a size); never retried."""


class ModelNotFound(EmbeddingError):
    """NOT_FOUND: no such model or version on the server."""


class Overloaded(EmbeddingError):
    """RESOURCE_EXHAUSTED: the server's queue (or the tenant's limit, or an answer budget) is full: retried."""


class Unavailable(EmbeddingError):
    """UNAVAILABLE: the server is starting, draining, restarting or unreachable: retried."""


class Unauthenticated(EmbeddingError):
    """UNAUTHENTICATED: no accepted API key."""


class DeadlineExceeded(EmbeddingError):
    """DEADLINE_EXCEEDED: the call's timeout passed."""


_KINDS: dict[grpc.StatusCode, type[EmbeddingError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: ModelNotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
}
RETRYABLE = (Overloaded, Unavailable)
"""What a retry may cure: a full queue and a server that is away for a moment."""


def error_of(code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> EmbeddingError:
    """The typed error of a status."""
    return _KINDS.get(code, EmbeddingError)(code, message, retry_after_s)


def rpc_error(error: grpc.RpcError) -> EmbeddingError:
    """The typed error of a failed call (blocking or asyncio), with the server's retry hint if it sent one."""
    hint = None
    for key, value in error.trailing_metadata() or ():
        if key == RETRY_AFTER_METADATA:
            try:
                hint = float(value)
            except ValueError:
                hint = None
    return error_of(error.code(), error.details() or "", hint)
