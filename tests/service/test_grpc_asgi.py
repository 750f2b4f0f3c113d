"""The gRPC port as an ASGI application (service.frontends.grpc.asgi), driven as pyvoy drives it, without Envoy.

The health service stands in for every method: a unary Check and a server-streaming Watch, through
the real door (interceptor.ErrorInterceptor). The whole port on Envoy runs in the end-to-end suites
(make test's ENCODER_GRPC_TRANSPORT=envoy pass).
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
    trailers: dict[str, str] = field(default_factory=dict)

    @property
    def grpc_status(self) -> grpc.StatusCode | None:
        code = self.trailers.get("grpc-status")
        return None if code is None else next(c for c in grpc.StatusCode if c.value[0] == int(code))

    @property
    def grpc_message(self) -> str:
        return framing.read_status_message(self.trailers.get("grpc-message", "").encode())


class Channel:
    """One call's ASGI channel as pyvoy gives it: the body, then empty chunks until the client is `gone`."""

    def __init__(self, body: bytes) -> None:
        self._body: bytes | None = body
        self.gone = asyncio.Event()
        self.answer = Answer()
        self.reads_after_body = 0

    async def receive(self) -> dict[str, Any]:
        if self._body is not None:
            body, self._body = self._body, None
            return {"type": "http.request", "body": body, "more_body": False}
        self.reads_after_body += 1
        if self.gone.is_set():
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.answer.status = message["status"]
        elif message["type"] == "http.response.body" and message.get("body"):
            body = message["body"]
            self.answer.messages.append(body[framing.PREFIX_BYTES :])
        elif message["type"] == "http.response.trailers":
            self.answer.trailers = {key.decode(): value.decode() for key, value in message["headers"]}


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


async def test_a_handlers_error_becomes_its_status_and_message(app: GrpcAsgiApp) -> None:
    answer = await call(app, Channel(check_request("nope")), CHECK)
    assert answer.grpc_status == grpc.StatusCode.NOT_FOUND and answer.grpc_message == "unknown service 'nope'"
    assert answer.messages == []


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
    assert answer.trailers == {}  # no status for a client that is gone
    assert channel.reads_after_body >= 1


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
