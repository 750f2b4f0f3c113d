"""The asyncio client: the tasks of client.base, the calls a task asks together sent concurrently, with retries."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc
from google.protobuf.message import Message

from client.base import BaseClient, Call, Result, Steps
from client.channels import asyncio_connections
from client.errors import rpc_error

MAX_IN_FLIGHT_PER_CONNECTION = 8
"""Requests of one call the client keeps unanswered per connection."""


class AsyncEmbeddingClient(BaseClient):
    """asyncio client: `await AsyncEmbeddingClient(target).embed(texts)`; a call's batches are sent concurrently.

    The same methods and settings as EmbeddingClient (BaseClient); create it inside the event loop.
    """

    _connect = staticmethod(asyncio_connections)

    async def _run(self, steps: Steps[Result]) -> Result:
        """A task's result, the calls it asks together sent concurrently."""
        try:
            calls = next(steps)
            while True:
                calls = steps.send(await self._calls(calls))
        except StopIteration as finished:
            return finished.value

    async def _calls(self, calls: Sequence[Call]) -> list[Message]:
        """Every call's answer, in order, a bounded number in flight."""
        if len(calls) == 1:
            return [await self._call(calls[0])]
        slots = asyncio.Semaphore(MAX_IN_FLIGHT_PER_CONNECTION * self.connection_count)

        async def bounded(call: Call) -> Message:
            async with slots:
                return await self._call(call)

        return list(await asyncio.gather(*(bounded(call) for call in calls)))

    async def _call(self, call: Call) -> Message:
        attempt = 0
        while True:
            attempt += 1
            try:
                return await self._sent_call(call)
            except grpc.aio.AioRpcError as failure:
                error = rpc_error(failure)
            await asyncio.sleep(self._retry_delay_s(call, error, attempt))

    async def close(self) -> None:
        """Close the connections."""
        for channel in self.connections.channels:
            await channel.close()

    async def __aenter__(self) -> AsyncEmbeddingClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
