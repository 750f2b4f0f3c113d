"""Several connections per server address, used in turn.

gRPC channels of one process that are opened with the same target and arguments share one
subchannel, so one TCP connection, per address: a client process then reaches one front end of a
`--frontends N` server (each front end process takes whole connections), and one connection's
HTTP/2 flow control and one server thread bound what it can send. Each channel here gets a
subchannel pool of its own (`grpc.use_local_subchannel_pool`), so `connections` channels are that
many TCP connections to each address. A `dns:///` target is balanced round-robin over every address
its name resolves to (a headless Kubernetes Service), as docs/operations.md recommends.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar

import grpc

from protocol import grpc_service_pb2_grpc as pb_grpc
from protocol.channel_security import ClientSecurity

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
Channel = TypeVar("Channel", grpc.Channel, grpc.aio.Channel)


def connection_options(target: str, index: int, max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, object]]:
    """The arguments of the `index`-th channel to target: its own connection, round-robin over a `dns:///` name.

    No retry policy: the clients retry themselves (client.retry), with jitter and the server's hint.
    """
    options: list[tuple[str, object]] = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.use_local_subchannel_pool", 1),
        # Distinct arguments as well, so no layer that keys connections by arguments merges two channels.
        ("encoder.client.connection", index),
    ]
    if target.startswith("dns:"):
        options.append(("grpc.service_config", json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})))
    return options


class Connections(Generic[Channel]):
    """`count` channels to one target and a stub on each, handed out in turn."""

    def __init__(self, channels: Sequence[Channel]) -> None:
        if not channels:
            raise ValueError("at least one connection is needed")
        self.channels = list(channels)
        self.stubs = [pb_grpc.GRPCInferenceServiceStub(channel) for channel in self.channels]
        self._turn: Iterator[pb_grpc.GRPCInferenceServiceStub] = itertools.cycle(self.stubs)

    def next_stub(self) -> pb_grpc.GRPCInferenceServiceStub:
        """The next connection's stub, round-robin."""
        return next(self._turn)


def blocking_connections(target: str, count: int, security: ClientSecurity) -> Connections[grpc.Channel]:
    """`count` blocking channels to target, each its own connection."""
    _check_count(count)
    return Connections([security.channel(target, connection_options(target, index)) for index in range(count)])


def asyncio_connections(target: str, count: int, security: ClientSecurity) -> Connections[grpc.aio.Channel]:
    """`count` asyncio channels to target, each its own connection (open them inside the event loop)."""
    _check_count(count)
    return Connections([security.aio_channel(target, connection_options(target, index)) for index in range(count)])


def _check_count(count: int) -> None:
    if count < 1:
        raise ValueError(f"connections must be at least 1, got {count}")
