"""Typed errors for what the server refuses or fails, each carrying the server's reason and status."""

from __future__ import annotations

import re
from collections.abc import Sequence

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


class MessageTooLarge(EmbeddingError):
    """RESOURCE_EXHAUSTED for a request past the server's message limit (--max-message-bytes): never retried."""


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
MESSAGE_TOO_LARGE = "Received message larger than max"
"""How gRPC words its RESOURCE_EXHAUSTED for a message past the receiver's limit (a grpcio server prefixes it with
"SERVER: "): the same request fails again."""
REFUSED_ITEM = re.compile(r"\binput (?:text|image)\[(\d+)\]|\bimage (\d+)\b")
"""How the server names a refused text or image: by its index in the request (`input text[3]`, `image 3`)."""


def error_of(code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> EmbeddingError:
    """The typed error of a status."""
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and MESSAGE_TOO_LARGE in message:
        return MessageTooLarge(code, message, retry_after_s)
    return _KINDS.get(code, EmbeddingError)(code, message, retry_after_s)


def refused_index(message: str) -> int | None:
    """The index in its request of the text or image a refusal names, or None where it names none."""
    found = REFUSED_ITEM.search(message)
    return None if found is None else int(found.group(1) or found.group(2))


def named_item(error: EmbeddingError, places: Sequence[int]) -> EmbeddingError:
    """A refusal of a request whose row i was the call's item places[i], saying which item: `inputs[37]: ...`."""
    index = refused_index(error.message)
    if not isinstance(error, InvalidRequest) or index is None or index >= len(places):
        return error
    return type(error)(error.code, f"inputs[{places[index]}]: {error.message}", error.retry_after_s)


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
