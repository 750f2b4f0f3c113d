"""Just enough HTTP/1.1 for the stress suite: one request per connection, of which only the status is read.

The status line tells how the server answered (`HTTP 413`, `HTTP 429`, `HTTP 200`...); the rest
of the answer is never read, so a client that holds the connection afterwards is a slow reader:
the server's answer waits in socket buffers (and the server's) until the connection closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Sequence

from protocol.channel_security import ClientSecurity
from tools.stress.rawh2 import CLOSED, PENDING, RawConnection
from tools.stress.result import UNANSWERED


def request_bytes(
    method: str, path: str, authority: str, body: bytes, metadata: Sequence[tuple[str, str]] = ()
) -> bytes:
    """One HTTP/1.1 request asking the server to close the connection after its answer."""
    lines = [
        f"{method} {path} HTTP/1.1",
        f"host: {authority}",
        "connection: close",
        *(f"{name}: {value}" for name, value in metadata),
    ]
    if body:
        lines += ["content-type: application/json", f"content-length: {len(body)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


async def status(
    host: str,
    port: int,
    security: ClientSecurity,
    request: bytes,
    *,
    safety_timeout_s: float,
    hold_s: float = 0.0,
    leave_after_hold: bool = False,
) -> str:
    """Send one request on a new connection and read its status line: `HTTP <code>`.

    With `hold_s`, the connection stays open that long after the request was sent, nothing more
    read. UNANSWERED when no status came within the safety timeout; CONNECTION_CLOSED when the
    server closed the connection without one. OSError when it cannot connect. With
    `leave_after_hold`, the client waits for the status only until the hold ends, and leaves
    (PENDING) if none came.
    """
    connection = RawConnection(host, port, security, alpn="http/1.1")
    await asyncio.wait_for(connection.open(), safety_timeout_s)
    loop = asyncio.get_running_loop()
    hold_until = loop.time() + hold_s
    try:
        # The server may answer (and close) before it read the whole body: its status is still there to read.
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            await connection.send(request)
        assert connection.reader is not None
        wait_s = max(0.0, hold_until - loop.time()) if leave_after_hold else safety_timeout_s
        try:
            line = await asyncio.wait_for(connection.reader.readline(), wait_s)
        except asyncio.TimeoutError:
            return PENDING if leave_after_hold else UNANSWERED
        except (ConnectionError, ssl.SSLError):
            return CLOSED
        parts = line.split()
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
            return CLOSED
        await asyncio.sleep(max(0.0, hold_until - loop.time()))
        return f"HTTP {int(parts[1])}"
    finally:
        # Not a graceful close: with TLS it would wait for the server's close_notify, which waits behind
        # the answer this client never reads.
        connection.abort()
