"""The gRPC port as an ASGI application (service.frontends.grpc.asgi), driven as pyvoy drives it, without Envoy.

The health service stands in for every method: a unary Check and a server-streaming Watch, through
the real door (interceptor.ErrorInterceptor). The whole port on Envoy runs in the end-to-end suites
(Envoy is the transport make test's main pass serves gRPC with).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.envelope import Envelope
from service.frontends.grpc import framing
from service.frontends.grpc.asgi import DEADLINE_EXCEEDED, SHUTTING_DOWN_MESSAGE, GrpcAsgiApp
from service.frontends.grpc.health import SERVING, HealthService
from service.frontends.grpc.interceptor import ErrorInterceptor
from service.ops.settings import Settings
from service.pipeline.api import Pipeline

CHECK = "/grpc.health.v1.Health/Check"
WATCH = "/grpc.health.v1.Health/Watch"


@dataclass
class Answer:
    """What the application sent for one call."""

    status: int | None = None
    messages: list[bytes] = field(default_factory=list)
    status_fields: dict[str, str] = field(default_factory=dict)
    """The gRPC status's fields: the trailers, or the headers of a Trailers-Only response."""
    trailers_only: bool = False
    ended: bool = False
    """Whether the whole response was sent."""

    @property
    def grpc_status(self) -> grpc.StatusCode | None:
        code = self.status_fields.get("grpc-status")
        return None if code is None else next(c for c in grpc.StatusCode if c.value[0] == int(code))

    @property
    def grpc_message(self) -> str:
        return framing.read_status_message(self.status_fields.get("grpc-message", "").encode())


class Channel:
    """One call's ASGI channel as pyvoy gives it: the body, then empty chunks until the stream is over.

    It is over when the client is `gone`, or once the status was sent and the client has `taken` the
    response (at once, unless the channel is made with `reading=False`).
    """

    def __init__(
        self, body: bytes, *, reading: bool = True, holding_sends: bool = False, holding_receives: bool = False
    ) -> None:
        self._body: bytes | None = body
        self._holding_sends = holding_sends
        self.held_sends: list[asyncio.Future[None]] = []
        """With `holding_sends`: each send of a message with more to follow waits here, as pyvoy's waits for Envoy."""
        self._holding_receives = holding_receives
        self.held_receives: list[asyncio.Future[dict[str, Any]]] = []
        """With `holding_receives`: each receive after the body waits here for its event, as pyvoy's does."""
        self.gone = asyncio.Event()
        self.taken = asyncio.Event()
        if reading:
            self.taken.set()
        self.answer = Answer()
        self.reads_after_body = 0

    async def receive(self) -> dict[str, Any]:
        if self._body is not None:
            body, self._body = self._body, None
            return {"type": "http.request", "body": body, "more_body": False}
        self.reads_after_body += 1
        if self._holding_receives:
            self.held_receives.append(asyncio.get_running_loop().create_future())
            return await self.held_receives[-1]
        if self.gone.is_set() or (self.answer.ended and self.taken.is_set()):
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(self, message: dict[str, Any]) -> None:
        answer = self.answer
        if self._holding_sends and message.get("more_body", False):
            self.held_sends.append(asyncio.get_running_loop().create_future())
            await self.held_sends[-1]
        if message["type"] == "http.response.start":
            answer.status = message["status"]
            answer.trailers_only = not message.get("trailers", False)
            if answer.trailers_only:
                answer.status_fields = {key.decode(): value.decode() for key, value in message["headers"]}
        elif message["type"] == "http.response.body":
            if message.get("body"):
                answer.messages.append(message["body"][framing.PREFIX_BYTES :])
            answer.ended = answer.trailers_only and not message.get("more_body", False)
        elif message["type"] == "http.response.trailers":
            answer.status_fields = {key.decode(): value.decode() for key, value in message["headers"]}
            answer.ended = not message.get("more_trailers", False)


def scope(path: str, *headers: tuple[bytes, bytes], content_type: bytes = b"application/grpc") -> dict[str, Any]:
    return {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [(b"content-type", content_type), (b"te", b"trailers"), *headers],
        "client": ("127.0.0.1", 50000),
    }


@pytest.fixture
async def app() -> GrpcAsgiApp:
    door = Envelope(Pipeline(Settings(model_repository=Path("unused"))), api_keys=None)
    grpc_app = GrpcAsgiApp(ErrorInterceptor(door), max_receive_bytes=1024, max_send_bytes=1024)
    health = HealthService()
    health_pb2_grpc.add_HealthServicer_to_server(health, grpc_app)
    await health.set("", SERVING)
    return grpc_app


def check_request(service: str = "") -> bytes:
    return framing.frame(health_pb2.HealthCheckRequest(service=service).SerializeToString())


async def call(app: GrpcAsgiApp, channel: Channel, path: str, *headers: tuple[bytes, bytes]) -> Answer:
    await app(scope(path, *headers), channel.receive, channel.send)
    return channel.answer


async def test_a_unary_call_is_answered_with_its_message_and_an_ok_status(app: GrpcAsgiApp) -> None:
    answer = await call(app, Channel(check_request()), CHECK)
    assert answer.status == 200 and answer.grpc_status == grpc.StatusCode.OK
    assert [health_pb2.HealthCheckResponse.FromString(message).status for message in answer.messages] == [SERVING]


async def test_a_call_ends_only_once_its_client_has_taken_the_response(app: GrpcAsgiApp) -> None:
    channel = Channel(check_request(), reading=False)
    unary = asyncio.create_task(call(app, channel, CHECK))

    async def asked_again(times: int) -> None:  # whether Envoy has sent it all
        while not channel.answer.ended:
            await asyncio.sleep(0.01)
        reads = channel.reads_after_body
        while channel.reads_after_body < reads + times and not unary.done():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(asked_again(3), 5)
    assert not unary.done()  # so the answer's bytes stay in the answer budget (released when the call ends)
    channel.taken.set()
    answer = await asyncio.wait_for(unary, 5)
    assert answer.grpc_status == grpc.StatusCode.OK


async def test_a_handlers_error_becomes_its_status_and_message(app: GrpcAsgiApp) -> None:
    answer = await call(app, Channel(check_request("nope")), CHECK)
    assert answer.grpc_status == grpc.StatusCode.NOT_FOUND and answer.grpc_message == "unknown service 'nope'"
    assert answer.messages == []
    assert answer.trailers_only  # the status alone, in the response's headers, as grpc answers it


async def test_unknown_methods_undecodable_bodies_and_oversized_messages(app: GrpcAsgiApp) -> None:
    unknown = await call(app, Channel(check_request()), "/grpc.health.v1.Health/Nope")
    assert (unknown.grpc_status, unknown.grpc_message) == (grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
    cut = await call(app, Channel(check_request()[:-1] + b"\xff\xff"), CHECK)
    assert cut.grpc_status == grpc.StatusCode.INTERNAL and "ended inside a message" in cut.grpc_message
    oversized = await call(app, Channel(framing.frame(b"x" * 1025)), CHECK)
    assert oversized.grpc_status == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert oversized.grpc_message == "Received message larger than max (1025 vs. 1024)"
    snappy = await call(app, Channel(check_request()), CHECK, (b"grpc-encoding", b"snappy"))
    assert snappy.grpc_status == grpc.StatusCode.UNIMPLEMENTED and "snappy" in snappy.grpc_message
    garbled = await call(app, Channel(check_request()), CHECK, (b"grpc-timeout", b"soon"))
    assert garbled.grpc_status == grpc.StatusCode.INTERNAL and "is not a timeout" in garbled.grpc_message


async def test_a_call_that_is_not_grpc_gets_415(app: GrpcAsgiApp) -> None:
    channel = Channel(b"{}")
    await app(scope(CHECK, content_type=b"application/json"), channel.receive, channel.send)
    assert channel.answer.status == 415


async def test_grpc_timeout_ends_a_call_deadline_exceeded(app: GrpcAsgiApp) -> None:
    answer = await call(app, Channel(check_request()), WATCH, (b"grpc-timeout", b"200m"))
    # Watch sends the current status, then waits for a change that never comes.
    assert len(answer.messages) == 1
    assert (answer.grpc_status, answer.grpc_message) == (grpc.StatusCode.DEADLINE_EXCEEDED, DEADLINE_EXCEEDED)


async def test_a_client_gone_cancels_the_call_and_nothing_more_is_sent(app: GrpcAsgiApp) -> None:
    channel = Channel(check_request())
    watch = asyncio.create_task(call(app, channel, WATCH))
    while not channel.answer.messages:  # the current status was sent: the call waits for a change
        await asyncio.sleep(0.01)
    channel.gone.set()
    answer = await asyncio.wait_for(watch, 5)
    assert answer.status_fields == {}  # no status for a client that is gone
    assert channel.reads_after_body >= 1


async def test_a_call_cancelled_while_a_send_waits_leaves_pyvoys_future_to_pyvoy(app: GrpcAsgiApp) -> None:
    channel = Channel(check_request(), holding_sends=True)
    watch = asyncio.create_task(call(app, channel, WATCH))
    while not channel.held_sends:  # the current status waits for Envoy to take it
        await asyncio.sleep(0.01)
    channel.gone.set()
    await asyncio.wait_for(watch, 5)  # the client's going cancels the call
    (held,) = channel.held_sends
    assert not held.cancelled()
    held.set_exception(ConnectionResetError("the stream ended"))  # pyvoy's own end of it: no InvalidStateError


async def test_a_call_ended_while_a_receive_waits_leaves_pyvoys_future_to_pyvoy(app: GrpcAsgiApp) -> None:
    channel = Channel(check_request(), holding_receives=True)
    watch = asyncio.create_task(call(app, channel, WATCH, (b"grpc-timeout", b"300m")))
    while not channel.held_receives:  # the watch for a reset asks pyvoy for the stream's next event
        await asyncio.sleep(0.01)
    while not channel.answer.ended:  # the deadline ends the call while that receive waits
        await asyncio.sleep(0.01)
    assert channel.answer.grpc_status == grpc.StatusCode.DEADLINE_EXCEEDED
    assert not any(held.cancelled() for held in channel.held_receives)
    async with asyncio.timeout(5):
        while not watch.done():  # pyvoy answers each wait itself once the stream is over: no InvalidStateError
            for held in channel.held_receives:
                if not held.done():
                    held.set_result({"type": "http.disconnect"})
            await asyncio.sleep(0.01)


async def test_after_stop_new_calls_are_unavailable_and_running_ones_end(app: GrpcAsgiApp) -> None:
    channel = Channel(check_request())
    watch = asyncio.create_task(call(app, channel, WATCH))
    while not channel.answer.messages:
        await asyncio.sleep(0.01)
    await app.stop(grace_s=0.1)  # the Watch would run for ever: cancelled at the end of the grace
    with pytest.raises(asyncio.CancelledError):
        await watch
    assert channel.answer.grpc_status == grpc.StatusCode.CANCELLED
    refused = await call(app, Channel(check_request()), CHECK)
    assert (refused.grpc_status, refused.grpc_message) == (grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN_MESSAGE)
