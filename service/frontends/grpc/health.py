"""grpc.health.v1 (Check and Watch) over a table of service statuses, with an end for drained servers.

Watch sends a service's current status, then each change, for as long as the caller listens; a
server's graceful stop waits for every open call. So once the server has drained its inferences,
`end_watches` ends them (UNAVAILABLE, after each has been sent NOT_SERVING) instead of letting them
hold the stop for its whole grace period.
"""

from __future__ import annotations

import asyncio
import functools

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
ENDED_MESSAGE = "the server is shutting down"


class HealthService(health_pb2_grpc.HealthServicer):
    """The statuses of the server ("") and its models; every change wakes every Watch."""

    def __init__(self) -> None:
        self._statuses: dict[str, health_pb2.HealthCheckResponse.ServingStatus] = {}
        self._changed = asyncio.Condition()
        self._shutting_down = False
        self._watches_ended = False

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        """The service's status now; NOT_FOUND for a service this server does not know."""
        status = self._statuses.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        """The service's status (SERVICE_UNKNOWN while it has none), then each change, until `end_watches`."""
        sent = None
        while True:
            async with self._changed:
                await self._changed.wait_for(functools.partial(self._has_news, request.service, sent))
                status = self._status(request.service)
            if status == sent:  # nothing new to send: the watches were ended
                await context.abort(grpc.StatusCode.UNAVAILABLE, ENDED_MESSAGE)
            await context.write(health_pb2.HealthCheckResponse(status=status))
            sent = status

    def _status(self, service: str) -> health_pb2.HealthCheckResponse.ServingStatus:
        return self._statuses.get(service, SERVICE_UNKNOWN)

    def _has_news(self, service: str, sent: health_pb2.HealthCheckResponse.ServingStatus | None) -> bool:
        return self._watches_ended or self._status(service) != sent

    async def set(self, service: str, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        """Set a service's status; ignored once shutting down (everything stays NOT_SERVING)."""
        if self._shutting_down:
            return
        async with self._changed:
            self._statuses[service] = status
            self._changed.notify_all()

    async def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING for good."""
        async with self._changed:
            self._shutting_down = True
            self._statuses = dict.fromkeys(self._statuses, NOT_SERVING)
            self._changed.notify_all()

    async def end_watches(self) -> None:
        """End every open Watch, and any later one at once (each still gets the latest status first)."""
        async with self._changed:
            self._watches_ended = True
            self._changed.notify_all()
