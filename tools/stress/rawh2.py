"""Just enough HTTP/2 to play clients that gRPC's own library never plays: slow readers and garbage.

A slow reader here opens a connection whose stream flow-control window is 0 (SETTINGS
INITIAL_WINDOW_SIZE = 0) and never raises it: the server can send response headers but not one
byte of any response message, exactly as with a peer that stopped reading. The socket itself is
still read, but only to see frame headers: that grants no window. Headers are encoded as HPACK
literals (no Huffman, no indexing), which every HTTP/2 server must accept; response headers are
not decoded, only told apart: headers alone (the response is waiting on our window) or headers
that end the stream (a trailers-only answer: the server refused the call).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from protocol.channel_security import ClientSecurity

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA, _HEADERS, _RST_STREAM, _SETTINGS = 0x0, 0x1, 0x3, 0x4
_END_STREAM, _ACK, _END_HEADERS = 0x1, 0x1, 0x4
_SETTINGS_INITIAL_WINDOW_SIZE = 0x4
_FRAME_HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 16384
"""HTTP/2's default SETTINGS_MAX_FRAME_SIZE: the largest frame a client may send before it reads the server's."""

HELD = "HELD"
"""Outcome: response headers came, the message waits on our closed window (what a slow reader causes)."""
REFUSED = "TRAILERS_ONLY"
"""Outcome: the server ended the stream at once with a status (a refusal: overload, bad request...)."""
RESET = "RST_STREAM"
"""Outcome: the server reset the stream (for example past its concurrent-stream limit)."""
CLOSED = "CONNECTION_CLOSED"
"""Outcome: the server closed the connection."""
PENDING = "PENDING"
"""Outcome: accepted, still queued or running when the client left at the end of its hold (which cancels it)."""


def _integer(value: int) -> bytes:
    """HPACK integer with a 7-bit prefix."""
    if value < 127:
        return bytes([value])
    encoded = [127]
    value -= 127
    while value >= 128:
        encoded.append((value & 127) | 128)
        value >>= 7
    encoded.append(value)
    return bytes(encoded)


def _literal(name: str, value: str) -> bytes:
    """A header as an HPACK literal without indexing, with a new name."""
    name_bytes, value_bytes = name.encode(), value.encode()
    return b"\x00" + _integer(len(name_bytes)) + name_bytes + _integer(len(value_bytes)) + value_bytes


def frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    """One HTTP/2 frame."""
    return _FRAME_HEADER.pack(len(payload))[1:] + bytes([kind, flags]) + _FRAME_HEADER.pack(stream_id) + payload


def grpc_request_frames(
    stream_id: int, authority: str, method: str, message: bytes, metadata: Sequence[tuple[str, str]], *, tls: bool
) -> bytes:
    """HEADERS and DATA frames of one unary gRPC call carrying a serialized message."""
    headers = [
        (":method", "POST"),
        (":scheme", "https" if tls else "http"),
        (":path", method),
        (":authority", authority),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        *metadata,
    ]
    block = b"".join(_literal(name, value) for name, value in headers)
    body = b"\x00" + _FRAME_HEADER.pack(len(message)) + message
    chunks = [body[start : start + MAX_FRAME_BYTES] for start in range(0, len(body), MAX_FRAME_BYTES)]
    data = b"".join(frame(_DATA, 0, stream_id, chunk) for chunk in chunks[:-1])
    return frame(_HEADERS, _END_HEADERS, stream_id, block) + data + frame(_DATA, _END_STREAM, stream_id, chunks[-1])


def split_target(target: str) -> tuple[str, int] | None:
    """(host, port) of a `host:port`, `[v6]:port` or `dns:///host:port` target; None for other forms."""
    if target.startswith("dns:///"):
        target = target[len("dns:///") :]
    host, separator, port = target.rpartition(":")
    if not separator or not port.isdigit() or not host or "/" in host:
        return None
    return host.strip("[]"), int(port)


def ssl_context(security: ClientSecurity, alpn: str) -> ssl.SSLContext | None:
    """A client TLS context offering one application protocol (`h2`, `http/1.1`); None without TLS."""
    if not security.uses_tls:
        return None
    context = ssl.create_default_context(cafile=None if security.ca_file is None else str(security.ca_file))
    if security.cert_file is not None and security.key_file is not None:
        context.load_cert_chain(str(security.cert_file), str(security.key_file))
    context.set_alpn_protocols([alpn])
    return context


@dataclass
class RawConnection:
    """One raw TCP (or TLS) connection to the server."""

    host: str
    port: int
    security: ClientSecurity
    alpn: str = "h2"
    """The application protocol offered in the TLS handshake."""
    reader: asyncio.StreamReader | None = None
    writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        """Connect (and handshake, with TLS)."""
        context = ssl_context(self.security, self.alpn)
        server_hostname = (self.security.server_name or self.host) if context is not None else None
        self.reader, self.writer = await asyncio.open_connection(
            self.host, self.port, ssl=context, server_hostname=server_hostname
        )

    async def send(self, data: bytes) -> None:
        """Write bytes and flush them to the socket."""
        assert self.writer is not None
        self.writer.write(data)
        await self.writer.drain()

    async def close(self) -> None:
        """Close the connection."""
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(OSError, ssl.SSLError):
                await self.writer.wait_closed()

    def abort(self) -> None:
        """Drop the connection at once, unsent and unread bytes with it (no TLS close_notify exchange)."""
        if self.writer is not None:
            self.writer.transport.abort()

    async def read_frame(self) -> tuple[int, int, int, bytes] | None:
        """(type, flags, stream id, payload) of the next frame, or None once the server closed."""
        assert self.reader is not None
        try:
            header = await self.reader.readexactly(9)
            length = int.from_bytes(header[:3], "big")
            payload = await self.reader.readexactly(length)
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            return None
        return header[3], header[4], int.from_bytes(header[5:9], "big") & 0x7FFFFFFF, payload


async def slow_reader(
    host: str,
    port: int,
    security: ClientSecurity,
    *,
    method: str,
    messages: Sequence[bytes],
    hold_s: float,
    safety_timeout_s: float,
    leave_after_hold: bool = False,
) -> list[str]:
    """Send unary calls on one connection whose window stays 0; never read a response message.

    Holds the connection for `hold_s`, and until every stream got its first response frame or
    `safety_timeout_s` passed; returns each stream's outcome (HELD, TRAILERS_ONLY, RST_STREAM,
    CONNECTION_CLOSED, or UNANSWERED when nothing came back). With `leave_after_hold`, the
    connection closes once `hold_s` has passed whatever came back: a stream without any response
    frame by then is PENDING.
    """
    connection = RawConnection(host, port, security)
    await asyncio.wait_for(connection.open(), safety_timeout_s)
    stream_ids = [1 + 2 * index for index in range(len(messages))]
    outcomes: dict[int, str] = {}
    authority = f"{host}:{port}"
    data = PREFACE + frame(_SETTINGS, 0, 0, struct.pack(">HI", _SETTINGS_INITIAL_WINDOW_SIZE, 0))
    # The server's own SETTINGS always come first: acknowledge them without reading them.
    data += frame(_SETTINGS, _ACK, 0, b"")
    for stream_id, message in zip(stream_ids, messages, strict=True):
        data += grpc_request_frames(stream_id, authority, method, message, security.metadata(), tls=security.uses_tls)
    loop = asyncio.get_running_loop()
    hold_until = loop.time() + hold_s
    try:
        await connection.send(data)
        watch_s = max(0.0, hold_until - loop.time()) if leave_after_hold else safety_timeout_s
        await asyncio.wait_for(_watch(connection, stream_ids, outcomes), watch_s)
        await asyncio.sleep(max(0.0, hold_until - loop.time()))
    except asyncio.TimeoutError:
        pass
    finally:
        # Not a graceful close: with TLS it would wait (up to 30 s) for a close_notify the server may never send.
        connection.abort()
    missing = PENDING if leave_after_hold else "UNANSWERED"
    return [outcomes.get(stream_id, missing) for stream_id in stream_ids]


async def _watch(connection: RawConnection, stream_ids: Sequence[int], outcomes: dict[int, str]) -> None:
    """Read frames until every stream has an outcome (or the server closes: the rest are CLOSED)."""
    waiting = set(stream_ids)
    while waiting:
        received = await connection.read_frame()
        if received is None:
            for stream_id in waiting:
                outcomes[stream_id] = CLOSED
            return
        kind, flags, stream_id, _ = received
        if stream_id not in waiting:
            continue
        if kind == _HEADERS:
            outcomes[stream_id] = REFUSED if flags & _END_STREAM else HELD
        elif kind == _RST_STREAM:
            outcomes[stream_id] = RESET
        elif kind == _DATA:
            # Only an empty DATA frame fits in a zero window; count it as held.
            outcomes[stream_id] = HELD
        else:
            continue
        waiting.discard(stream_id)


async def garbage_connection(
    host: str, port: int, security: ClientSecurity, payload: bytes, safety_timeout_s: float
) -> str:
    """Send bytes that are not HTTP/2 (after the TLS handshake, with TLS); CONNECTION_CLOSED or UNANSWERED."""
    connection = RawConnection(host, port, security)
    await asyncio.wait_for(connection.open(), safety_timeout_s)
    try:
        await connection.send(payload)
        assert connection.reader is not None

        async def until_closed() -> None:
            with contextlib.suppress(ConnectionError, ssl.SSLError):
                while await connection.reader.read(65536):
                    pass

        await asyncio.wait_for(until_closed(), safety_timeout_s)
    except asyncio.TimeoutError:
        return "UNANSWERED"
    except (ConnectionError, ssl.SSLError):
        return CLOSED
    finally:
        await connection.close()
    return CLOSED
