"""ModelStreamInfer: Triton's bidirectional stream of inference requests, answered in order.

Each message is one ModelInferRequest, run exactly as ModelInfer runs it, and answered with a
ModelStreamInferResponse carrying the request's id. Answers leave in the order the requests
arrived (as Triton answers a stream to a model that is not decoupled), while up to
`max_inflight` of them run at once. A request that fails is answered with `error_message` and
its id; the stream goes on.

Flow control: a stream reads its next message only when fewer than `max_inflight` of its
requests are unanswered (running, or answered and not yet taken by gRPC's flow control), so a
producer faster than the model, or a client that stops reading answers, is held back by HTTP/2
flow control instead of growing the server's memory.

Drain: `close()` stops every open stream from reading; each answers the requests it had
accepted, then ends with UNAVAILABLE so its client knows to reconnect (elsewhere) for the rest.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from service.errors import ServiceError, Unavailable
from service.proto import grpc_service_pb2 as pb

log = logging.getLogger(__name__)

MAX_INFLIGHT_PER_STREAM = 32
"""Unanswered requests one stream may hold before the server stops reading it."""
DRAINING_MESSAGE = "the server is shutting down: this stream's accepted requests were answered; reconnect to go on"

Infer = Callable[[pb.ModelInferRequest, float | None], Awaitable[pb.ModelInferResponse]]
"""One inference (request, monotonic deadline or None) -> response; raises ServiceError."""


class InferenceStreams:
    """The server's open inference streams: each one's ordering and flow control, and their end at a drain."""

    def __init__(self, infer: Infer, max_inflight: int = MAX_INFLIGHT_PER_STREAM) -> None:
        if max_inflight < 1:
            raise ValueError("max_inflight must be at least 1")
        self._infer = infer
        self._max_inflight = max_inflight
        self._readers: set[asyncio.Task[None]] = set()
        self._closing = False

    def close(self) -> None:
        """Stop reading every stream (and refuse new ones): each answers what it accepted, then ends."""
        self._closing = True
        for reader in self._readers:
            reader.cancel()

    async def serve(
        self, requests: AsyncIterator[pb.ModelInferRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Answer a stream's requests in order until the client closes its side, or the server drains."""
        if self._closing:
            await context.abort(Unavailable.code, DRAINING_MESSAGE)
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        slots = asyncio.Semaphore(self._max_inflight)
        answers: asyncio.Queue[asyncio.Task[pb.ModelStreamInferResponse] | None] = asyncio.Queue()
        reader = asyncio.get_running_loop().create_task(self._read(requests, deadline, slots, answers))
        self._readers.add(reader)
        reader.add_done_callback(self._readers.discard)
        try:
            while (answer := await answers.get()) is not None:
                response = await answer
                yield response
                slots.release()
        finally:
            reader.cancel()
            while not answers.empty():
                left = answers.get_nowait()
                if left is not None:
                    left.cancel()
        if reader.cancelled():
            await context.abort(Unavailable.code, DRAINING_MESSAGE)
        reader.result()  # a failed read (not a client's half-close) ends the stream with that error

    async def _read(
        self,
        requests: AsyncIterator[pb.ModelInferRequest],
        deadline: float | None,
        slots: asyncio.Semaphore,
        answers: asyncio.Queue[asyncio.Task[pb.ModelStreamInferResponse] | None],
    ) -> None:
        """Take a request whenever a slot is free; each starts at once and queues its answer in order.

        A slot is taken before reading, so a cancellation (a drain) never drops a request read
        from the wire: whatever was read is answered.
        """
        loop = asyncio.get_running_loop()
        try:
            while True:
                await slots.acquire()
                request = await anext(requests, None)
                if request is None:
                    return
                answers.put_nowait(loop.create_task(self._answer(request, deadline)))
        finally:
            answers.put_nowait(None)

    async def _answer(self, request: pb.ModelInferRequest, deadline: float | None) -> pb.ModelStreamInferResponse:
        """One request's answer: its response, or its error in error_message with its id."""
        try:
            return pb.ModelStreamInferResponse(infer_response=await self._infer(request, deadline))
        except ServiceError as error:
            message = str(error)
        except Exception:
            log.exception("unhandled error in a ModelStreamInfer request")
            message = "internal error; see the server log"
        identity = pb.ModelInferResponse(
            model_name=request.model_name, model_version=request.model_version, id=request.id
        )
        return pb.ModelStreamInferResponse(error_message=message, infer_response=identity)
