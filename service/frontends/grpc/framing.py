"""gRPC's wire format over HTTP/2, for a gRPC port served by a plain HTTP/2 server (service.frontends.grpc.asgi).

A message travels as a 5-byte prefix (a compressed flag, then its length, 4 bytes big-endian) and
its bytes; a call's status travels in trailers (`grpc-status`, `grpc-message` percent-encoded);
`grpc-timeout` carries the caller's deadline; `grpc-encoding` names a compressed message's codec.
"""

from __future__ import annotations

import base64
import zlib
from collections.abc import Iterator
from urllib.parse import quote, unquote

PREFIX_BYTES = 5
TIMEOUT_UNITS_S = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
"""grpc-timeout's units: hours, minutes, seconds, milli-, micro-, nanoseconds."""
DECODERS = {"identity": None, "gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
"""The message codecs this port reads, as zlib's window bits (it always answers uncompressed)."""
ACCEPTED_ENCODINGS = ", ".join(DECODERS)
MESSAGE_SAFE = "".join(chr(code) for code in range(0x20, 0x7F) if chr(code) != "%")
"""grpc-message's characters sent as they are; others are percent-encoded (UTF-8)."""


class FramingError(Exception):
    """The request's bytes break gRPC's framing (a message cut short, an unknown codec)."""


class MessageTooLarge(FramingError):
    """A message past the port's receive limit (gRPC answers RESOURCE_EXHAUSTED)."""


def frame(message: bytes) -> bytes:
    """One uncompressed message, prefixed."""
    return b"\0" + len(message).to_bytes(4, "big") + message


def timeout_s(value: str) -> float:
    """A grpc-timeout header's seconds ('100m' is 0.1); FramingError if it is not one."""
    unit = TIMEOUT_UNITS_S.get(value[-1:])
    digits = value[:-1]
    if unit is None or not digits.isdigit() or len(digits) > 8:
        raise FramingError(f"grpc-timeout {value!r} is not a timeout (up to 8 digits and a unit of H M S m u n)")
    return int(digits) * unit


def status_message(message: str) -> bytes:
    """A grpc-message trailer's value: the text percent-encoded as gRPC asks."""
    return quote(message, safe=MESSAGE_SAFE).encode("ascii")


def metadata_value(key: str, value: bytes) -> str | bytes:
    """A metadata entry's value as grpc gives it to handlers: `-bin` keys base64-decoded to bytes."""
    if key.endswith("-bin"):
        return base64.b64decode(value + b"=" * (-len(value) % 4))
    return value.decode("latin-1")


def base64_value(value: bytes) -> bytes:
    """A `-bin` metadata value as sent: base64 without padding."""
    return base64.b64encode(value).rstrip(b"=")


def read_status_message(value: bytes) -> str:
    """A grpc-message trailer's text (for tests and the client side)."""
    return unquote(value.decode("ascii"))


class MessageReader:
    """Cuts a request body's chunks into messages, decompressing those flagged with `encoding`'s codec.

    `max_message_bytes` bounds each message as received and once decompressed.
    """

    def __init__(self, encoding: str, max_message_bytes: int) -> None:
        if encoding not in DECODERS:
            raise FramingError(f"grpc-encoding {encoding!r} is not supported (this port reads {ACCEPTED_ENCODINGS})")
        self._window_bits = DECODERS[encoding]
        self._max_bytes = max_message_bytes
        self._buffer = bytearray()

    def feed(self, chunk: bytes) -> Iterator[bytes]:
        """The messages completed by this chunk."""
        self._buffer += chunk
        while len(self._buffer) >= PREFIX_BYTES:
            length = int.from_bytes(self._buffer[1:PREFIX_BYTES], "big")
            self._check_size(length)
            end = PREFIX_BYTES + length
            if len(self._buffer) < end:
                return
            compressed = self._buffer[0]
            message = bytes(self._buffer[PREFIX_BYTES:end])
            del self._buffer[:end]
            yield self._decompressed(message) if compressed else message

    def finish(self) -> None:
        """The body ended: FramingError if it ended inside a message."""
        if self._buffer:
            raise FramingError(f"the request ended inside a message ({len(self._buffer)} bytes of it)")

    def _check_size(self, length: int) -> None:
        if length > self._max_bytes:
            raise MessageTooLarge(f"Received message larger than max ({length} vs. {self._max_bytes})")

    def _decompressed(self, message: bytes) -> bytes:
        if self._window_bits is None:
            raise FramingError("a message is flagged compressed, but the call's grpc-encoding is identity")
        decompressor = zlib.decompressobj(self._window_bits)
        try:  # never more than one byte past the limit: a small message must not expand without bound
            plain = decompressor.decompress(message, self._max_bytes + 1)
        except zlib.error as error:
            raise FramingError(f"a compressed message does not decompress: {error}") from error
        self._check_size(len(plain))
        if not decompressor.eof:
            raise FramingError("a compressed message ends before its codec's end")
        return plain
