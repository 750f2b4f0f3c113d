"""`python -m tools.mixed_load`: a new user's mixed load against one server, for minutes; every outcome counted.

The clients, each in a thread of its own with a connection of its own (as clients in separate
processes; gRPC would share one between the clients of one process):
- 3 tritonclient unary clients, each request 1-8 texts;
- 1 tritonclient streaming client keeping 16 requests in flight; a stream the server ends (its
  connection's age, a drain) is reopened and what it left unanswered sent again;
- 2 OpenAI clients (`/v1/embeddings` on the HTTP port, one kept-alive connection each), 1-8 texts;
- 1 tritonclient unary client with 20 ms deadlines;
- 1 client sending malformed requests (tools.stress.nonsense), MALFORMED_PER_S a second.
Printed as JSON: requests, outcomes by status for each client, how each stream ended, the
streamed requests never answered, and the server's RSS (every process of it, from /proc) at the
start, largest and at the end. Exit status 0 when nothing was lost (no unary call UNAVAILABLE,
INTERNAL, UNKNOWN or CANCELLED, no HTTP 5xx or broken connection, no stream ended any other way
than by the server's end-of-stream message, no streamed request left unanswered), 1 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import http.client
import itertools
import json
import queue
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import numpy as np
import tritonclient.grpc as triton

from protocol import grpc_service_pb2_grpc as pb_grpc
from service.frontends.grpc.streaming import STREAM_ENDED_MESSAGE, UNANSWERED_MESSAGE
from service.launch.processes import children
from tools.loadtest.corpus import load_corpus
from tools.stress.monitor import read_rss_bytes
from tools.stress.nonsense import nonsense_request

STREAM_IN_FLIGHT = 16
DEADLINE_S = 0.02
MALFORMED_PER_S = 10
LOST_STATUSES = frozenset({"UNAVAILABLE", "INTERNAL", "UNKNOWN", "CANCELLED"})
"""Unary outcomes that may mean a call was lost (the client cannot tell whether it ran)."""
SERVER_ENDED = "server end-of-stream"
CLIENT_CLOSED = "OK (client closed)"
STREAM_SILENCE_S = 60
"""A stream that answers nothing for this long is given up (and counted so) by the streaming client."""
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
"""Each client a connection of its own, as clients in separate processes have."""
RSS = "rss MB"


@dataclass
class Outcomes:
    """Counts by client and outcome, shared by the client threads."""

    counts: dict[str, collections.Counter[str]] = field(
        default_factory=lambda: collections.defaultdict(collections.Counter)
    )
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, client: str, outcome: str, count: int = 1) -> None:
        """`count` more of `outcome` for `client`."""
        with self.lock:
            self.counts[client][outcome] += count

    def of(self, client: str, outcome: str) -> int:
        """How many of `outcome` `client` has had so far."""
        with self.lock:
            return self.counts[client][outcome]

    def lost(self) -> int:
        """Calls or streamed requests lost, and streams not ended by the server's end-of-stream message."""
        total = 0
        with self.lock:
            for client, counts in self.counts.items():
                for outcome, count in counts.items():
                    if client == "stream ends":
                        total += count * (outcome not in (SERVER_ENDED, CLIENT_CLOSED))
                    elif client == "stream":
                        total += count * (outcome != "OK")
                    elif client != RSS:
                        status = outcome.partition(":")[0]
                        total += count * (status in LOST_STATUSES or status.startswith("HTTP 5") or "Error" in status)
        return total

    def report(self) -> dict[str, object]:
        """Requests, lost, and every count, as plain data."""
        with self.lock:
            counts = {client: dict(sorted(seen.items())) for client, seen in sorted(self.counts.items())}
        requests = sum(sum(seen.values()) for client, seen in counts.items() if client not in (RSS, "stream ends"))
        return {"requests": requests, "lost": self.lost(), "outcomes": counts}


def _texts_input(texts: list[str]) -> triton.InferInput:
    tensor = triton.InferInput("text", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([text.encode() for text in texts], dtype=object))
    return tensor


def _status(error: triton.InferenceServerException) -> str:
    return str(error.status() or "UNKNOWN").removeprefix("StatusCode.")


def _outcome(error: triton.InferenceServerException) -> str:
    """A failed call's status; with its message when it may have been lost (the message says why)."""
    status = _status(error)
    return f"{status}: {' '.join(error.message().split())[:120]}" if status in LOST_STATUSES else status


def unary_client(
    name: str, target: str, model: str, stop: threading.Event, outcomes: Outcomes, *, deadline_s: float = 0.0
) -> None:
    """Tritonclient unary calls of 1-8 texts until `stop`; `deadline_s` per call (0: none)."""
    rng, texts = random.Random(name), load_corpus("short")
    client = triton.InferenceServerClient(target, channel_args=OWN_CONNECTION)
    try:
        while not stop.is_set():
            chunk = [rng.choice(texts) for _ in range(rng.randint(1, 8))]
            try:
                client.infer(model, [_texts_input(chunk)], client_timeout=deadline_s or None)
                outcomes.add(name, "OK")
            except triton.InferenceServerException as error:
                outcomes.add(name, _outcome(error))
    finally:
        client.close()


class StreamingClient:
    """A tritonclient stream with STREAM_IN_FLIGHT requests unanswered until `stop`; ended streams reopened.

    What a stream the server ended left unanswered is sent again on the next, as its end-of-stream message asks.

    Answers come in the order of the requests: one with an error_message (tritonclient gives it without its
    id) belongs to the oldest request waiting.
    """

    def __init__(self, target: str, model: str, stop: threading.Event, outcomes: Outcomes) -> None:
        self.model, self.stop, self.outcomes = model, stop, outcomes
        self.client = triton.InferenceServerClient(target, channel_args=OWN_CONNECTION)
        self.rng, self.texts = random.Random("stream"), load_corpus("short")
        self.waiting: collections.OrderedDict[str, list[str]] = collections.OrderedDict()
        """Requests sent (or to send again) and not answered, oldest first."""
        self.events: queue.Queue[tuple[str, str]] = queue.Queue()
        self.numbers = itertools.count()

    def run(self) -> None:
        """Streams one after another until `stop`, then until every request is answered or a stream fails."""
        try:
            while self.waiting or not self.stop.is_set():
                ended = self._one_stream()
                if ended is None:
                    self.outcomes.add("stream ends", CLIENT_CLOSED)
                elif STREAM_ENDED_MESSAGE in ended:
                    self.outcomes.add("stream ends", SERVER_ENDED)
                else:
                    self.outcomes.add("stream ends", " ".join(ended.split())[:200])
                    if self.stop.is_set():
                        break
        finally:
            self.client.close()
        if self.waiting:
            self.outcomes.add("stream", "NEVER_ANSWERED", len(self.waiting))

    def _one_stream(self) -> str | None:
        """One stream, until it ends (how, as tritonclient says it) or every request is answered after `stop` (None)."""
        self.client.start_stream(callback=self._callback)
        for request_id, chunk in self.waiting.items():  # what the last stream left, sent again
            self._send(request_id, chunk)
        ended = None
        while ended is None and (self.waiting or not self.stop.is_set()):
            while len(self.waiting) < STREAM_IN_FLIGHT and not self.stop.is_set():
                request_id = f"s{next(self.numbers)}"
                self.waiting[request_id] = [self.rng.choice(self.texts)]
                self._send(request_id, self.waiting[request_id])
            try:
                kind, detail = self.events.get(timeout=STREAM_SILENCE_S)
            except queue.Empty:
                kind, detail = "end", f"no answer for {STREAM_SILENCE_S} s"
            if kind == "end":
                ended = detail
            else:
                self._answered(kind, detail)
        self.client.stop_stream(cancel_requests=ended is not None)
        return ended

    def _answered(self, kind: str, detail: str) -> None:
        if not self.waiting:
            self.outcomes.add("stream", "ANSWER_NOT_ASKED_FOR")
        elif kind == "answer" and detail != next(iter(self.waiting)):
            self.outcomes.add("stream", "OUT_OF_ORDER")
            self.waiting.pop(detail, None)
        elif kind == "answer":
            self.waiting.popitem(last=False)
            self.outcomes.add("stream", "OK")
        elif UNANSWERED_MESSAGE not in detail:  # else it stays, to be sent again on the next stream
            self.waiting.popitem(last=False)
            self.outcomes.add("stream", "ERROR_ANSWER")

    def _callback(self, result: triton.InferResult | None, error: triton.InferenceServerException | None) -> None:
        if result is not None:
            self.events.put(("answer", result.get_response().id))
        elif error is not None and error.status() is None:  # an answer's error_message
            self.events.put(("error answer", error.message()))
        else:
            self.events.put(("end", f"{_status(error)} {error.message()}" if error is not None else "no status"))

    def _send(self, request_id: str, texts: list[str]) -> None:
        """Write one request; a stream already ended takes none (its end reaches the callback)."""
        with contextlib.suppress(triton.InferenceServerException):
            self.client.async_stream_infer(self.model, [_texts_input(texts)], request_id=request_id)


def openai_client(name: str, http_target: str, model: str, stop: threading.Event, outcomes: Outcomes) -> None:
    """POST /v1/embeddings of 1-8 texts on one kept-alive connection until `stop`."""
    rng, texts = random.Random(name), load_corpus("short")
    host, port = http_target.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        while not stop.is_set():
            body = json.dumps({"model": model, "input": [rng.choice(texts) for _ in range(rng.randint(1, 8))]})
            try:
                connection.request("POST", "/v1/embeddings", body, {"content-type": "application/json"})
                answer = connection.getresponse()
                answer.read()
                outcomes.add(name, f"HTTP {answer.status}")
            except (OSError, http.client.HTTPException) as error:
                outcomes.add(name, type(error).__name__)
                connection.close()
    finally:
        connection.close()


def malformed_client(target: str, model: str, stop: threading.Event, outcomes: Outcomes) -> None:
    """MALFORMED_PER_S requests a second that are not valid for the model, over gRPC, until `stop`."""
    rng = random.Random("malformed")
    with grpc.insecure_channel(target, options=OWN_CONNECTION) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        while not stop.wait(1 / MALFORMED_PER_S):
            try:
                stub.ModelInfer(nonsense_request(rng, model), timeout=30)
                outcomes.add("malformed", "OK")
            except grpc.RpcError as error:
                code = error.code().name
                lost = code in LOST_STATUSES
                outcomes.add(
                    "malformed", f"{code}: {' '.join((error.details() or '').split())[:120]}" if lost else code
                )


def clients(
    target: str, http_target: str, model: str, stop: threading.Event, outcomes: Outcomes
) -> list[threading.Thread]:
    """The mixed load's client threads, not started."""
    work: list[tuple[Callable[..., None], tuple[object, ...], dict[str, object]]] = [
        *((unary_client, (f"unary-{i}", target, model, stop, outcomes), {}) for i in range(3)),
        (StreamingClient(target, model, stop, outcomes).run, (), {}),
        *((openai_client, (f"openai-{i}", http_target, model, stop, outcomes), {}) for i in range(2)),
        (unary_client, ("deadline-20ms", target, model, stop, outcomes), {"deadline_s": DEADLINE_S}),
        (malformed_client, (target, model, stop, outcomes), {}),
    ]
    return [threading.Thread(target=function, args=args, kwargs=kwargs) for function, args, kwargs in work]


def server_rss_bytes(pid: int) -> int:
    """The RSS of a server's every process (the one started and its children), from /proc."""
    return sum(read_rss_bytes(process) or 0 for process in (pid, *children(pid)))


def run(target: str, http_target: str, model: str, duration_s: float, server_pid: int | None) -> Outcomes:
    """Every client for `duration_s` (then until each has its last answer), the server's RSS sampled each second."""
    outcomes, stop = Outcomes(), threading.Event()
    threads = clients(target, http_target, model, stop, outcomes)
    for thread in threads:
        thread.start()
    stop_at = time.monotonic() + duration_s
    rss: list[int] = []
    while any(thread.is_alive() for thread in threads):
        if time.monotonic() >= stop_at:
            stop.set()
        if server_pid is not None:
            rss.append(server_rss_bytes(server_pid))
        threads[0].join(1.0)
    if rss:
        outcomes.add(RSS, "start", rss[0] // 2**20)
        outcomes.add(RSS, "largest", max(rss) // 2**20)
        outcomes.add(RSS, "end", rss[-1] // 2**20)
    return outcomes


def main(argv: list[str] | None = None) -> int:
    """Run the mixed load and print its outcomes; 0 when nothing was lost."""
    parser = argparse.ArgumentParser(prog="python -m tools.mixed_load", description=__doc__.split("\n")[0])
    parser.add_argument("--target", required=True, help="HOST:PORT of the server's gRPC port")
    parser.add_argument("--http-target", required=True, help="HOST:PORT of the server's HTTP port")
    parser.add_argument("--model", default="all-MiniLM-L6-v2", help="model name (default all-MiniLM-L6-v2)")
    parser.add_argument("--duration-s", type=float, default=180.0, help="how long the clients send (default 180)")
    parser.add_argument("--server-pid", type=int, help="the server's process id, for its RSS (children summed)")
    arguments = parser.parse_args(argv)
    outcomes = run(arguments.target, arguments.http_target, arguments.model, arguments.duration_s, arguments.server_pid)
    print(json.dumps(outcomes.report(), indent=1))
    return 1 if outcomes.lost() else 0


if __name__ == "__main__":
    sys.exit(main())
