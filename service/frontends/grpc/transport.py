"""The gRPC port's transport: grpc.aio's channel options, the services registered on it, reflection, connection age.

Whoever serves the port (grpc.aio, or Envoy through service.frontends.grpc.asgi) registers the same
services here; the limits gRPC itself enforces follow the server's settings, and the connection-age
constants keep a ModelStreamInfer stream within its connection's life.
"""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from protocol import grpc_service_pb2 as pb
from protocol import grpc_service_pb2_grpc as pb_grpc
from protocol import model_config_pb2 as mc
from service.frontends.grpc.asgi import GrpcAsgiApp
from service.frontends.grpc.health import HealthService
from service.frontends.grpc.servicer import InferenceServicer
from service.ops.settings import Settings

INFERENCE_SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
CONNECTION_AGE_GRACE_S = 30
"""After a connection's GOAWAY, how long its calls may go on beyond --max-connection-age-s (more than a
ModelStreamInfer stream lasts): more than streaming.ANSWER_WINDOW_S, so a stream begun just before its
connection's GOAWAY sends its last answers before gRPC closes the connection."""
STREAM_AGE_SHARE = 0.8
"""A ModelStreamInfer stream ends this share of --max-connection-age-s after it began. gRPC sends GOAWAY at
0.9-1.1 times the age (its jitter), and closes a connection past GOAWAY as soon as its last stream ends:
a client still writing then gets a reset and may lose the stream's status and last answers. A stream begun
as its connection opened (as clients do) thus ends a tenth of the age before that, on a healthy connection."""
RESPONSE_FRAMING_BYTES = 64 * 1024
"""Room for a response's protobuf fields around its output tensors (--max-response-bytes counts the tensors)."""
UNREQUESTED_CALL_TIMEOUT_S = 30
"""gRPC cancels a call its handlers have not picked up within this long (its own default, made explicit)."""


def max_send_bytes(settings: Settings) -> int:
    """The largest message the port sends: --max-response-bytes of tensors, and the fields around them."""
    return settings.max_response_bytes + RESPONSE_FRAMING_BYTES


def reflection_pool() -> descriptor_pool.DescriptorPool:
    """A descriptor pool holding every service served, for the reflection service.

    Our stubs live in a private pool (see protocol/pool.py); health and reflection in the
    default one. Reflection answers from a single pool, so this one gathers all four files.
    """
    pool = descriptor_pool.DescriptorPool()
    for file in (mc.DESCRIPTOR, pb.DESCRIPTOR, health_pb2.DESCRIPTOR, reflection_pb2.DESCRIPTOR):
        proto = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(proto)
        pool.Add(proto)
    return pool


def grpc_options(settings: Settings, max_receive_bytes: int, reuse_port: bool = False) -> list[tuple[str, int]]:
    """Channel arguments: every limit gRPC itself enforces, set on purpose.

    gRPC core keeps calls that arrived before a handler could take them in its own queue, and
    past `grpc.server.max_pending_requests` (default 1000, hard limit 3000) it cancels them at
    random: a burst then gets CANCELLED, which clients do not retry. That queue is sized far above
    the model queue, so `--max-queue-size` is the bound that answers (RESOURCE_EXHAUSTED); streams
    per connection are capped so one client cannot fill it. `reuse_port`: several front-end
    processes listen on the port, and the kernel spreads new connections among them. `max_receive_bytes`:
    the largest message received (service.ops.message_limits).
    """
    options = [
        ("grpc.max_receive_message_length", max_receive_bytes),
        ("grpc.max_send_message_length", max_send_bytes(settings)),
        ("grpc.max_concurrent_streams", settings.max_concurrent_streams),
        ("grpc.server.max_pending_requests", settings.max_pending_rpcs),
        ("grpc.server.max_pending_requests_hard_limit", settings.max_pending_rpcs),
        ("grpc.server_max_unrequested_time_in_server", UNREQUESTED_CALL_TIMEOUT_S),
        ("grpc.so_reuseport", 1 if reuse_port else 0),
    ]
    if settings.max_connection_age_s > 0:
        options += [
            ("grpc.max_connection_age_ms", int(settings.max_connection_age_s * 1000)),
            (
                "grpc.max_connection_age_grace_ms",
                int((settings.max_connection_age_s + CONNECTION_AGE_GRACE_S) * 1000),
            ),
        ]
    return options


class GenericHandlersOnly:
    """Stands in for a server while generated code adds a service: its handlers become generic handlers only.

    Generated `add_*_to_server` functions also register every method with gRPC core. grpc.aio's
    accept loop then keeps one pending call per registered method (about 30 here) and waits on all
    of them with `asyncio.wait` for every RPC it accepts; with generic handlers it waits on one, for
    less server CPU per call (docs/decisions.md#generic-grpc-handlers-only).
    """

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers: tuple[grpc.GenericRpcHandler, ...]) -> None:
        """Added as they are."""
        self._server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        """Ignored: the same handlers were just added as a generic handler."""


def add_services(
    servicer: InferenceServicer, health: HealthService, services: GenericHandlersOnly | GrpcAsgiApp
) -> None:
    """Register what the gRPC port serves: the inference service, grpc.health.v1 and server reflection."""
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, services)
    health_pb2_grpc.add_HealthServicer_to_server(health, services)
    reflected = (
        INFERENCE_SERVICE,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    )
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
        reflection.aio.ReflectionServicer(reflected, pool=reflection_pool()), services
    )
