"""The stream phase's client: short requests on ModelStreamInfer, each stream the server ends reopened.

The server may end a stream (its connection's age, a drain): it answers every request it had read,
then ends the stream UNAVAILABLE telling the client to send the rest on a new stream. Requests the
client wrote that the server never read are the client's to send again, as a real client would; a
request counts UNANSWERED only when it is still unanswered when the phase ends. Answers must come
in the order of the requests (each carries its own id).

This client uses gRPC's synchronous API, in a thread: grpc.aio reports a write that races the
server's end of the stream as INTERNAL "Internal error from Core", hiding the server's own status
(grpc/grpc#36066), and the server's status is what this phase checks.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence

import grpc

from client.protocol import text_request
from protocol import grpc_service_pb2 as pb
from protocol import grpc_service_pb2_grpc as pb_grpc
from tools.loadtest.corpus import load_corpus
from tools.stress.result import UNANSWERED, Tally

STREAM_WINDOW = 8
"""Requests kept written and unanswered at once on a stream."""
REOPEN_HINT = "new stream"
"""What the server's message says when it ended a stream (or left a request unanswered) for the client to
send the rest again on a new one."""
RESTREAMS_AFTER_TIME = 3
"""Streams that may still be opened after the time is up, to send what an ended stream left."""
STREAM_RECYCLED = "STREAM_RECYCLED"
"""Outcome of a stream the server ended UNAVAILABLE telling the client to reopen it."""
OUT_OF_ORDER = "OUT_OF_ORDER"
"""Outcome of an answer that is not to the oldest request waiting on its stream."""
ERROR_MESSAGE = "ERROR_MESSAGE"
"""Outcome of a request answered with an error_message (other than one asking to send it again)."""


class _Stream:
    """One stream's requests: written and not yet answered, in order, shared by the writing and reading threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.window = threading.Semaphore(STREAM_WINDOW)
        self.outstanding: deque[pb.ModelInferRequest] = deque()
        self.ended = False

    def end(self) -> list[pb.ModelInferRequest]:
        """Stop the writer (it takes no further request) and return what is left unanswered."""
        with self.lock:
            self.ended = True
            left = list(self.outstanding)
        self.window.release()  # a writer waiting for a slot wakes, sees the end and returns
        return left


class StreamSender:
    """Sends short requests on ModelStreamInfer until a time, reopening each stream the server ends."""

    def __init__(
        self,
        stub: pb_grpc.GRPCInferenceServiceStub,
        model: str,
        metadata: Sequence[tuple[str, str]],
        rng: random.Random,
        *,
        safety_timeout_s: float,
        tally: Tally,
    ) -> None:
        self.stub = stub
        self.model = model
        self.metadata = tuple(metadata)
        self.rng = rng
        self.safety_timeout_s = safety_timeout_s
        self.tally = tally
        self.unsent: deque[pb.ModelInferRequest] = deque()
        """Requests to send (again) on the next stream: an ended stream left them unanswered."""
        self.numbers = itertools.count()
        self.streams = 0
        self.recycled = 0
        """Streams the server ended UNAVAILABLE telling the client to reopen them."""
        self.resent = 0
        self.first_error: str | None = None

    def run(self, stop_at: float) -> None:
        """Open streams one after another until `stop_at` (monotonic), then until nothing is left to send.

        Blocks: run it in a thread.
        """
        after_time = 0
        while time.monotonic() < stop_at or (self.unsent and after_time < RESTREAMS_AFTER_TIME):
            after_time += time.monotonic() >= stop_at
            if not self._one_stream(stop_at):
                break
        self.tally.add_all([UNANSWERED] * len(self.unsent))
        self.unsent.clear()

    def _one_stream(self, stop_at: float) -> bool:
        """Send and read on one stream; whether another may follow (it ended OK or recycled, in time).

        The stream's deadline is the phase's time left plus the safety timeout: past it, what the
        server has not answered counts UNANSWERED.
        """
        stream = _Stream()
        self.streams += 1
        timeout_s = max(0.0, stop_at - time.monotonic()) + self.safety_timeout_s
        responses = self.stub.ModelStreamInfer(
            self._requests(stream, stop_at), metadata=self.metadata, timeout=timeout_s
        )
        code, details = grpc.StatusCode.OK, ""
        try:
            for response in responses:
                self._answered(stream, response)
        except grpc.RpcError as error:
            code, details = error.code(), error.details() or ""
        left = stream.end()
        if code in (grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED):
            # Ended OK after our half-close, what it left is lost; past the deadline, never answered.
            self.tally.add_all([UNANSWERED] * len(left))
            if code == grpc.StatusCode.OK:
                return True
        else:
            self.unsent.extend(left)
            self.resent += len(left)
            if code == grpc.StatusCode.UNAVAILABLE and REOPEN_HINT in details:
                self.recycled += 1
                self.tally.add(STREAM_RECYCLED)
                return True
        self.tally.add(f"STREAM_{code.name}")
        self.tally.notes.append(f"a stream ended {code.name}: {' '.join(details.split())[:200]}")
        return False

    def _requests(self, stream: _Stream, stop_at: float) -> Iterator[pb.ModelInferRequest]:
        """The stream's requests, one per free slot: those to send again first, new ones until `stop_at`."""
        texts = load_corpus("short")
        while True:
            stream.window.acquire()
            with stream.lock:
                if stream.ended:
                    return
                if self.unsent:
                    request = self.unsent.popleft()
                elif time.monotonic() < stop_at:
                    request = text_request(self.model, [self.rng.choice(texts)])
                    request.id = f"stream-{next(self.numbers)}"
                else:
                    return
                stream.outstanding.append(request)  # sent or not, it is answered or sent again
            yield request

    def _answered(self, stream: _Stream, response: pb.ModelStreamInferResponse) -> None:
        answer_id = response.infer_response.id
        with stream.lock:
            if stream.outstanding and stream.outstanding[0].id == answer_id:
                request = stream.outstanding.popleft()
            else:
                request = None
                kept = [waiting for waiting in stream.outstanding if waiting.id != answer_id]
                stream.outstanding.clear()
                stream.outstanding.extend(kept)
        stream.window.release()
        if request is None:
            self.tally.add(OUT_OF_ORDER)
        elif REOPEN_HINT in response.error_message:
            self.unsent.append(request)
            self.resent += 1
        elif response.error_message:
            self.first_error = self.first_error or response.error_message
            self.tally.add(ERROR_MESSAGE)
        else:
            self.tally.add("OK")
