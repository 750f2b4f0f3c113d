"""ModelStreamInfer: Triton's bidirectional stream of inference requests, answered in order.

Each message is one ModelInferRequest, run exactly as ModelInfer runs it, and answered with a
ModelStreamInferResponse carrying the request's id. Answers leave in the order the requests
arrived (as Triton answers a stream to a model that is not decoupled), while up to
`max_inflight` of them run at once. A request that fails is answered with `error_message` and
its id; the stream goes on. So is a message whose bytes are not a ModelInferRequest at all: the
error door (service.frontends.grpc.interceptor) parses each message as it is read and refuses such a one with
InvalidArgument, and it is answered in its place with `error_message` and no id. Triton's clients
take a per-message failure from the callback and keep the stream, so one bad message costs one
answer, not the stream and the requests behind it; a stream never ends UNKNOWN.

Flow control: a stream reads its next message only when fewer than `max_inflight` of its
requests are unanswered (running, or answered and not yet taken by gRPC's flow control), so a
producer faster than the model, or a client that stops reading answers, is held back by HTTP/2
flow control instead of growing the server's memory.

End: the server ends a stream in two cases, and in both it stops reading, answers every request
it had accepted (read from the wire), then ends it UNAVAILABLE with STREAM_ENDED_MESSAGE: the
client resends what was not answered on a new stream.
- Drain: `close()` stops every open stream.
- Age (`max_age_s`, 0.8 x --max-connection-age-s: service.frontends.grpc.transport.STREAM_AGE_SHARE says why): a stream
  stops reading that long after it began.
  gRPC sends a connection GOAWAY at its age and closes it hard a grace period later; a stream
  begins no later than the GOAWAY, so the server sets that grace above `max_age_s` plus
  `answer_window_s` (service.frontends.grpc.transport), and the stream is over before its connection is. An
  accepted request still unanswered `answer_window_s` after the stream stopped reading is
  cancelled and answered with UNANSWERED_MESSAGE, so the stream ends in time whatever the load.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from protocol import grpc_service_pb2 as pb
from service.envelope import failed
from service.errors import ServiceError, Unavailable

log = logging.getLogger(__name__)

MAX_INFLIGHT_PER_STREAM = 32
"""Unanswered requests one stream may hold before the server stops reading it."""
ANSWER_WINDOW_S = 20.0
"""How long a stream past its age still waits for the requests it accepted (far above a batch's time)."""
STREAM_ENDED_MESSAGE = (
    "the server ended this stream (it is shutting down, or the stream reached its age limit, set by"
    " --max-connection-age-s): every request it accepted was answered; send the others on a new stream"
)
UNANSWERED_MESSAGE = "not answered before this stream had to end: send it again on a new stream"

Infer = Callable[[pb.ModelInferRequest, float | None], Awaitable[pb.ModelInferResponse]]
"""One inference (request, monotonic deadline or None) -> response; raises ServiceError."""


class InferenceStreams:
    """The server's open inference streams: each one's ordering, flow control and lifetime, and their end at a drain.

    `max_age_s` (None or 0: no bound) is the longest a stream reads requests; `answer_window_s` how
    long it then waits for the ones it accepted.
    """

    def __init__(
        self,
        infer: Infer,
        max_inflight: int = MAX_INFLIGHT_PER_STREAM,
        max_age_s: float | None = None,
        answer_window_s: float = ANSWER_WINDOW_S,
    ) -> None:
        if max_inflight < 1:
            raise ValueError("max_inflight must be at least 1")
        if (max_age_s or 0) < 0 or answer_window_s < 0:
            raise ValueError("max_age_s and answer_window_s must be >= 0")
        self._infer = infer
        self._max_inflight = max_inflight
        self._max_age_s = max_age_s or None
        self._answer_window_s = answer_window_s
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
        """Answer a stream's requests in order until the client closes its side, or the server ends the stream.

        Reading `requests` may raise ServiceError for a message that is not a request and still be
        read on (see service.frontends.grpc.interceptor); the stream ends with Unavailable when the server ends it.
        """
        if self._closing:
            raise Unavailable(STREAM_ENDED_MESSAGE)
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        slots = asyncio.Semaphore(self._max_inflight)
        answers: asyncio.Queue[asyncio.Future[pb.ModelStreamInferResponse] | None] = asyncio.Queue()
        running: set[asyncio.Task[pb.ModelStreamInferResponse]] = set()
        loop = asyncio.get_running_loop()
        reader = loop.create_task(self._read(requests, deadline, slots, answers, running))
        self._readers.add(reader)
        reader.add_done_callback(self._readers.discard)
        aged = False

        def stop_reading() -> None:
            nonlocal aged
            aged = True
            reader.cancel()

        timers = []
        if self._max_age_s is not None:  # one timer each per stream: nothing added to each request's path
            timers = [
                loop.call_later(self._max_age_s, stop_reading),
                loop.call_later(self._max_age_s + self._answer_window_s, _cut_off, running),
            ]
        try:
            while (answer := await answers.get()) is not None:
                yield await answer
                slots.release()
        finally:
            for timer in timers:
                timer.cancel()
            reader.cancel()
            _cut_off(running)
        if not reader.cancelled():
            reader.result()  # a failed read (not a client's half-close) ends the stream with that error
        if reader.cancelled() or aged or self._closing:
            # The server stopped reading. gRPC's reader may take that cancellation as the end of the
            # requests and return: a stream the client had not closed still ends Unavailable then.
            raise Unavailable(STREAM_ENDED_MESSAGE)

    async def _read(
        self,
        requests: AsyncIterator[pb.ModelInferRequest],
        deadline: float | None,
        slots: asyncio.Semaphore,
        answers: asyncio.Queue[asyncio.Future[pb.ModelStreamInferResponse] | None],
        running: set[asyncio.Task[pb.ModelStreamInferResponse]],
    ) -> None:
        """Take a request whenever a slot is free; each starts at once and queues its answer in order.

        A slot is taken before reading, so a cancellation (the stream's end) never drops a message
        read from the wire: whatever was read is answered.
        """
        loop = asyncio.get_running_loop()
        try:
            while True:
                await slots.acquire()
                try:
                    request = await anext(requests, None)
                except ServiceError as error:  # this message was not a request: refused in its place
                    refused = loop.create_future()
                    failure = failed(error, "a ModelStreamInfer message")
                    refused.set_result(_error_answer(pb.ModelInferRequest(), str(failure)))
                    answers.put_nowait(refused)
                    continue
                if request is None:
                    return
                answer = loop.create_task(self._answer(self._infer, request, deadline))
                running.add(answer)
                answer.add_done_callback(running.discard)
                answers.put_nowait(answer)
        finally:
            answers.put_nowait(None)

    @staticmethod
    async def _answer(
        infer: Infer, request: pb.ModelInferRequest, deadline: float | None
    ) -> pb.ModelStreamInferResponse:
        """One request's answer: its response, or its error in error_message with its id."""
        try:
            return pb.ModelStreamInferResponse(infer_response=await infer(request, deadline))
        except asyncio.CancelledError:
            # Only its stream cancels this task: at the stream's last moment, or with the stream gone.
            message = UNANSWERED_MESSAGE
        except Exception as error:
            message = str(failed(error, "a ModelStreamInfer request"))
        return _error_answer(request, message)


def _cut_off(running: set[asyncio.Task[pb.ModelStreamInferResponse]]) -> None:
    """Cancel a stream's requests still running: each is answered UNANSWERED_MESSAGE in its place."""
    for answer in list(running):
        answer.cancel()


def _error_answer(request: pb.ModelInferRequest, message: str) -> pb.ModelStreamInferResponse:
    """A failed request's answer: the message, with the request's model, version and id."""
    identity = pb.ModelInferResponse(model_name=request.model_name, model_version=request.model_version, id=request.id)
    return pb.ModelStreamInferResponse(error_message=message, infer_response=identity)
