"""The gRPC port as an ASGI application, for a compiled HTTP/2 server in front (Envoy: service.launch.envoy).

It runs the same method handlers a grpc.aio server runs (the servicer, health, reflection, behind
the same door: interceptor.ErrorInterceptor), giving each call a context with the part of
grpc.aio.ServicerContext they use. What grpc.aio does for them is done here: gRPC's framing and
status trailers (framing.py), the receive and send size limits, `grpc-timeout` as the call's
deadline, a reset stream cancelling its handler, compressed requests, and a drain that refuses new
calls and waits for the running ones.

Handler shapes served: unary (a coroutine), server streams written with `context.write` (a
coroutine) and bidirectional streams (an async generator), the shapes this server's services have.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, NoReturn

import grpc

from service.frontends.grpc import framing
from service.frontends.grpc.interceptor import ErrorInterceptor

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
StopListening = Callable[[], Awaitable[None]]
"""Ask the HTTP/2 server in front to take no new connections and send GOAWAY on its open ones."""
TRANSPORT_HEADERS = frozenset(
    {"content-type", "te", "grpc-timeout", "grpc-encoding", "grpc-accept-encoding", "host", "content-length"}
)
"""Request headers that are gRPC's transport, not the call's metadata (as grpc.aio leaves them out)."""
RESPONSE_HEADERS = [
    (b"content-type", b"application/grpc"),
    (b"grpc-accept-encoding", framing.ACCEPTED_ENCODINGS.encode()),
]
SHUTTING_DOWN_MESSAGE = "the server is shutting down: send this call to another replica"
METHOD_NOT_FOUND = "Method not found!"
"""grpc's own message for a method no service has."""
DEADLINE_EXCEEDED = "Deadline Exceeded"
DISCONNECT_POLL_S = 0.1
"""How often a call whose request was read looks whether its client is still there. pyvoy answers `receive`
at once after the body's end (an empty body) and http.disconnect once the stream is reset, so a reset is
seen by asking; a call answered sooner never asks."""
DELIVERY_FIRST_POLL_S = 0.001
DELIVERY_LAST_POLL_S = 1.0
"""After a call's status was sent, whether Envoy has sent the whole response is asked at once, then after
waits doubling from the first to the last, which then repeats: a client that does not read costs one
`receive` a second for each of its calls (--max-concurrent-streams of them on a connection at most)."""


class _Refused(Exception):
    """A call answered with a status before any handler runs."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class AsgiCall:
    """One call's context: the part of grpc.aio.ServicerContext the handlers use, over the call's ASGI channel."""

    def __init__(
        self,
        scope: Scope,
        send: Send,
        headers: _Headers,
        *,
        deadline: float | None,
        serializer: Callable[[Any], bytes] | None,
        max_send_bytes: int,
    ) -> None:
        self._scope = scope
        self._send = send
        self._headers = headers
        self._deadline = deadline
        self._serialize = serializer
        self._max_send_bytes = max_send_bytes
        self._trailing: list[tuple[str, str | bytes]] = []
        self._done_callbacks: list[Callable[[AsgiCall], None]] = []
        self.started = False
        """Whether the response's headers were sent."""
        self.body_closed = False
        """Whether the response's last message was sent (only the status is left)."""
        self.code = grpc.StatusCode.OK
        self.details = ""
        self.ended = False

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        """The caller's metadata, keys lower-case, `-bin` values as bytes."""
        return self._headers.metadata

    def peer(self) -> str:
        """The caller's address, as grpc writes it (`ipv4:127.0.0.1:50000`)."""
        client = self._scope.get("client")
        if not client:
            return "unknown"
        host, port = client[0], client[1]
        return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"

    def time_remaining(self) -> float | None:
        """Seconds left before the caller's deadline; None without one."""
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str | bytes]]) -> None:
        """Metadata to send with the call's status."""
        self._trailing = list(metadata)

    def add_done_callback(self, callback: Callable[[AsgiCall], None]) -> None:
        """Run `callback(call)` once the call has ended, however it ended."""
        self._done_callbacks.append(callback)

    def set_status(self, code: grpc.StatusCode, details: str) -> None:
        """The status the call will end with."""
        self.code, self.details = code, details

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Sequence[tuple[str, str | bytes]] = ()
    ) -> NoReturn:
        """End the call with this status (raises grpc.aio.AbortError, as grpc.aio does)."""
        self.set_status(code, details)
        if trailing_metadata:
            self.set_trailing_metadata(trailing_metadata)
        raise grpc.aio.AbortError(details)

    async def write(self, message: Any, last: bool = False) -> None:
        """Send one response message (a server stream's next one; `last`: a unary call's only one).

        The last message closes the body with it: pyvoy then answers at once, where a message with more
        to follow waits for Envoy to have taken it (a round trip between threads).
        """
        payload = self._serialize(message) if self._serialize is not None else message
        if len(payload) > self._max_send_bytes:
            await self.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"Sent message larger than max ({len(payload)} vs. {self._max_send_bytes})",
            )
        await self._start()
        self.body_closed = last
        message = {"type": "http.response.body", "body": framing.frame(payload), "more_body": not last}
        if last:
            await self._send(message)
        else:
            await _waiting_send(self._send, message)

    async def _start(self) -> None:
        if not self.started:
            self.started = True
            start = {"type": "http.response.start", "status": 200, "headers": RESPONSE_HEADERS, "trailers": True}
            await self._send(start)

    async def finish(self) -> None:
        """Send the status: as trailers after the messages, or alone (Trailers-Only) when no message went out."""
        status = [(b"grpc-status", str(self.code.value[0]).encode())]
        if self.details:
            status.append((b"grpc-message", framing.status_message(self.details)))
        status += [(key.encode(), _header_value(value)) for key, value in self._trailing]
        if not self.started:  # one HEADERS frame ending the stream, as grpc sends a status without a message
            self.started = True
            start = {"type": "http.response.start", "status": 200, "headers": RESPONSE_HEADERS + status}
            await self._send(start)
            await self._send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        if not self.body_closed:
            await self._send({"type": "http.response.body", "body": b"", "more_body": False})
        await self._send({"type": "http.response.trailers", "headers": status, "more_trailers": False})

    def ended_now(self) -> None:
        """The call is over (its answer delivered, or its client gone): its done callbacks run once."""
        if self.ended:
            return
        self.ended = True
        for callback in self._done_callbacks:
            try:
                callback(self)
            except Exception:
                log.exception("a gRPC call's done callback failed")


async def _waiting_send(send: Send, message: dict[str, Any]) -> None:
    """Send a message pyvoy answers once Envoy has taken it; cancelling the caller leaves pyvoy's future alone.

    pyvoy fails such a future itself when the stream ends first (the client gone); had the caller's
    cancellation already cancelled it, that would raise InvalidStateError on the event loop.
    """
    sending = asyncio.ensure_future(send(message))
    sending.add_done_callback(_read_outcome)
    await asyncio.shield(sending)


def _read_outcome(sending: asyncio.Future[None]) -> None:
    """Read a send's failure, so one that comes after its caller left is not reported as never retrieved."""
    if not sending.cancelled():
        sending.exception()


def _header_value(value: str | bytes) -> bytes:
    return framing.base64_value(value) if isinstance(value, bytes) else value.encode("latin-1")


class GrpcAsgiApp:
    """gRPC's services as an ASGI application: register handlers as on a grpc.aio server, serve, drain with `stop`.

    `stop_listening`: the server in front's own drain, started when this one's is.
    """

    def __init__(
        self,
        interceptor: ErrorInterceptor,
        max_receive_bytes: int,
        max_send_bytes: int,
        stop_listening: StopListening | None = None,
    ) -> None:
        self._interceptor = interceptor
        self._stop_listening = stop_listening
        self._max_receive_bytes = max_receive_bytes
        self._max_send_bytes = max_send_bytes
        self._services: list[grpc.GenericRpcHandler] = []
        self._calls: set[asyncio.Task[Any]] = set()
        self._stopping = False

    def add_generic_rpc_handlers(self, handlers: tuple[grpc.GenericRpcHandler, ...]) -> None:
        """Serve these services' methods (as grpc.Server.add_generic_rpc_handlers)."""
        self._services.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        """Ignored: generated code adds the same handlers as a generic handler too."""

    async def stop(self, grace_s: float) -> None:
        """Refuse new calls (UNAVAILABLE), close the listener; wait up to grace_s for running calls, then cancel."""
        self._stopping = True
        if self._stop_listening is not None:
            await self._stop_listening()
        running = set(self._calls)
        if running:
            _, late = await asyncio.wait(running, timeout=grace_s)
            for call in late:
                call.cancel()
            if late:
                await asyncio.wait(late)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one HTTP/2 request as one gRPC call."""
        if scope["type"] != "http":
            return
        headers = _Headers(scope["headers"])
        if scope["method"] != "POST" or not headers.transport.get("content-type", b"").startswith(b"application/grpc"):
            await _plain_refusal(send, 415, b"this port speaks gRPC (content-type application/grpc)")
            return
        task = asyncio.current_task()
        assert task is not None
        self._calls.add(task)
        try:
            await self._serve(scope, headers, receive, send, task)
        finally:
            self._calls.discard(task)

    async def _serve(self, scope: Scope, headers: _Headers, receive: Receive, send: Send, task: asyncio.Task) -> None:
        try:
            deadline, reader = self._transport(headers.transport)
            handler = await self._method(scope["path"], headers)
        except _Refused as refusal:
            call = AsgiCall(scope, send, headers, deadline=None, serializer=None, max_send_bytes=self._max_send_bytes)
            call.set_status(refusal.code, refusal.details)
            await call.finish()  # no handler ran: nothing waits for the call's end
            return
        call = AsgiCall(
            scope,
            send,
            headers,
            deadline=deadline,
            serializer=handler.response_serializer,
            max_send_bytes=self._max_send_bytes,
        )
        messages = _Messages(receive, reader, call, self._max_receive_bytes, task)
        try:
            if deadline is None:
                await self._run(handler, messages, call)
            else:
                async with asyncio.timeout_at(_loop_time(deadline)):
                    await self._run(handler, messages, call)
        except grpc.aio.AbortError:
            pass
        except TimeoutError:
            call.set_status(grpc.StatusCode.DEADLINE_EXCEEDED, DEADLINE_EXCEEDED)
        except asyncio.CancelledError:
            if not messages.disconnected:  # the server's drain ran out of time
                call.set_status(grpc.StatusCode.CANCELLED, "the server stopped before this call ended")
                try:
                    await call.finish()
                finally:
                    call.ended_now()
                raise
        except Exception:
            log.exception("unexpected error in gRPC method %s", scope["path"])
            call.set_status(grpc.StatusCode.UNKNOWN, "Unexpected error in RPC handling")
        finally:
            messages.stop_watching()
        try:
            if not messages.disconnected:  # else nobody is left to answer
                await call.finish()
                # The answer's bytes are the server's until Envoy has sent them (a client that does not read
                # holds them there): the call ends, and its done callbacks release them, only then.
                await messages.delivered()
        finally:
            call.ended_now()

    def _transport(self, headers: dict[str, bytes]) -> tuple[float | None, framing.MessageReader]:
        """The call's deadline (grpc-timeout) and message reader (grpc-encoding); _Refused for ones it cannot take."""
        timeout = headers.get("grpc-timeout")
        try:
            deadline = time.monotonic() + framing.timeout_s(timeout.decode("latin-1")) if timeout else None
        except framing.FramingError as error:
            raise _Refused(grpc.StatusCode.INTERNAL, str(error)) from error
        try:
            return deadline, framing.MessageReader(
                headers.get("grpc-encoding", b"identity").decode("latin-1"), self._max_receive_bytes
            )
        except framing.FramingError as error:
            raise _Refused(grpc.StatusCode.UNIMPLEMENTED, str(error)) from error

    async def _method(self, method: str, headers: _Headers) -> grpc.RpcMethodHandler:
        """The method's handler, through the door; _Refused when there is none to run."""
        if self._stopping:
            raise _Refused(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN_MESSAGE)
        handler = await self._interceptor.intercept_service(self._continuation, _CallDetails(method, headers))
        if handler is None:
            raise _Refused(grpc.StatusCode.UNIMPLEMENTED, METHOD_NOT_FOUND)
        return handler

    async def _continuation(self, details: _CallDetails) -> grpc.RpcMethodHandler | None:
        """The registered services' handler of the method (the door's continuation)."""
        for service in self._services:
            handler = service.service(details)
            if handler is not None:
                return handler
        return None

    async def _run(self, handler: grpc.RpcMethodHandler, messages: _Messages, call: AsgiCall) -> None:
        """Run the handler of whichever shape it is, sending what it answers."""
        if handler.stream_stream is not None:
            responses = handler.stream_stream(messages.stream(), call)
            async with contextlib.aclosing(responses):
                async for response in responses:
                    await call.write(response)
            return
        request = await messages.only_one()
        if handler.unary_unary is not None:
            await call.write(await handler.unary_unary(request, call), last=True)
        elif handler.unary_stream is not None:
            await handler.unary_stream(request, call)
        else:
            await call.abort(grpc.StatusCode.UNIMPLEMENTED, "client-streaming methods are not served on this port")


def _loop_time(deadline: float) -> float:
    """A monotonic deadline as the event loop's clock reads it."""
    return asyncio.get_running_loop().time() + (deadline - time.monotonic())


class _Headers:
    """A call's request headers: gRPC's transport headers, and its metadata (the rest), read when first asked for."""

    __slots__ = ("_metadata", "_raw", "transport")

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self._raw = raw
        self._metadata: tuple[tuple[str, str | bytes], ...] | None = None
        self.transport = {name: value for key, value in raw if (name := key.decode("latin-1")) in TRANSPORT_HEADERS}

    @property
    def metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        """Keys lower-case, `-bin` values base64-decoded, as grpc.aio gives them."""
        if self._metadata is None:
            pairs = ((key.decode("latin-1"), value) for key, value in self._raw)
            self._metadata = tuple(
                (key, framing.metadata_value(key, value))
                for key, value in pairs
                if key not in TRANSPORT_HEADERS and not key.startswith(":")
            )
        return self._metadata


class _CallDetails(grpc.HandlerCallDetails):
    """grpc.HandlerCallDetails: the method and the caller's metadata, as the door reads them."""

    def __init__(self, method: str, headers: _Headers) -> None:
        self.method = method
        self._headers = headers

    @property
    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        """The caller's metadata."""
        return self._headers.metadata


class _Messages:
    """A call's request messages read from its ASGI channel; the client going away cancels the call's work.

    pyvoy's `receive` waits for the body's next bytes, answers http.disconnect when the stream is
    reset, and once the body has ended answers at once (an empty body) until then. So a unary call's
    body is read, then a watcher asks every DISCONNECT_POLL_S whether its client is gone; a stream's
    body is read by a pump that keeps one `receive` waiting (and so sees a reset at once) while the
    messages read and not yet taken by the handler stay under `read_ahead_bytes`. Either cancels the
    work when the client is gone, as grpc.aio cancels a handler whose call is cancelled.
    """

    def __init__(
        self,
        receive: Receive,
        reader: framing.MessageReader,
        call: AsgiCall,
        read_ahead_bytes: int,
        work: asyncio.Task[Any],
    ) -> None:
        self._receive = receive
        self._reader = reader
        self._call = call
        self._read_ahead_bytes = read_ahead_bytes
        self._work = work
        self._watcher: asyncio.Task[None] | None = None
        self._first_look: asyncio.TimerHandle | None = None
        self._ready: collections.deque[bytes] = collections.deque()
        self._ready_bytes = 0
        self._changed = asyncio.Event()
        self._failure: tuple[grpc.StatusCode, str] | None = None
        self._ended = False
        self.disconnected = False

    async def _next_event(self) -> dict[str, Any]:
        """The call's next ASGI event; cancelling the caller (deadline, drain, stop_watching) leaves pyvoy's future be.

        pyvoy sets the future's result itself when the event comes: one cancelled by then made it log
        InvalidStateError as an error on the event loop (see _waiting_send).
        """
        receiving = asyncio.ensure_future(self._receive())
        receiving.add_done_callback(_read_outcome)
        return await asyncio.shield(receiving)

    async def only_one(self) -> bytes:
        """A unary call's one message (then the watcher starts)."""
        messages: list[bytes] = []
        while not self._ended:
            event = await self._next_event()
            if event["type"] == "http.disconnect":
                self._gone()
                raise asyncio.CancelledError
            self._take(event)
            messages += self._ready
            self._ready.clear()
            if self._failure is not None:
                await self._call.abort(*self._failure)
        # A timer, not a task, until the first look: most calls are answered before it fires.
        self._first_look = asyncio.get_running_loop().call_later(DISCONNECT_POLL_S, self._look)
        if len(messages) != 1:
            await self._call.abort(
                grpc.StatusCode.UNIMPLEMENTED, f"a unary method takes exactly one request message, not {len(messages)}"
            )
        return messages[0]

    async def stream(self) -> AsyncIterator[bytes]:
        """Every message of the request, as the pump reads them."""
        self._watcher = asyncio.get_running_loop().create_task(self._pump())
        while True:
            while not self._ready:
                if self._failure is not None:
                    await self._call.abort(*self._failure)
                if self._ended:
                    return
                self._changed.clear()
                await self._changed.wait()
            message = self._ready.popleft()
            self._ready_bytes -= len(message)
            self._changed.set()
            yield message

    def _take(self, event: dict[str, Any]) -> None:
        """A body chunk: its messages ready, the end or a framing failure noted."""
        try:
            for message in self._reader.feed(event.get("body", b"")):
                self._ready.append(message)
                self._ready_bytes += len(message)
            if not event.get("more_body", False):
                self._ended = True
                self._reader.finish()
        except framing.MessageTooLarge as error:
            self._ended, self._failure = True, (grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
        except framing.FramingError as error:
            self._ended, self._failure = True, (grpc.StatusCode.INTERNAL, str(error))

    async def _pump(self) -> None:
        while not self._ended:
            while self._ready_bytes > self._read_ahead_bytes:
                self._changed.clear()
                await self._changed.wait()
            event = await self._next_event()
            if event["type"] == "http.disconnect":
                self._gone()
                return
            self._take(event)
            self._changed.set()
        await self._watch()

    def _look(self) -> None:
        self._watcher = asyncio.get_running_loop().create_task(self._watch(first_wait_s=0.0))

    async def _watch(self, first_wait_s: float = DISCONNECT_POLL_S) -> None:
        await asyncio.sleep(first_wait_s)
        while (await self._next_event())["type"] != "http.disconnect":
            await asyncio.sleep(DISCONNECT_POLL_S)
        self._gone()

    def _gone(self) -> None:
        self.disconnected = True
        if self._work is not asyncio.current_task():
            self._work.cancel()

    async def delivered(self) -> None:
        """Wait until the server in front has sent the whole response (or the client went away).

        pyvoy answers http.disconnect once Envoy's stream is complete, which is when the response's
        last bytes were written to the connection: at once, unless the client's flow-control window
        holds them back. So ask at once, then at growing intervals (DELIVERY_FIRST_POLL_S up to
        DELIVERY_LAST_POLL_S).
        """
        wait_s = DELIVERY_FIRST_POLL_S
        while (await self._next_event())["type"] != "http.disconnect":
            await asyncio.sleep(wait_s)
            wait_s = min(2 * wait_s, DELIVERY_LAST_POLL_S)

    def stop_watching(self) -> None:
        """The call is over."""
        if self._first_look is not None:
            self._first_look.cancel()
        if self._watcher is not None:
            self._watcher.cancel()


async def _plain_refusal(send: Send, status: int, body: bytes) -> None:
    """An HTTP answer to a request that is not a gRPC call."""
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": body})
