"""The stress suite's phases: each sends a bounded amount of hostile load and tallies every outcome.

Every request has an outcome: its gRPC status name, or UNANSWERED when no response came within
the safety timeout (the request is then cancelled). Requests are sent without a gRPC deadline,
except where deadlines are the point, so that a server which never answers is seen as such
rather than hidden behind the client's own DEADLINE_EXCEEDED. Each phase is bounded in count,
and in time by its counts and the safety timeout. The phases stay in one module (just over 500
lines): they share the outcome tally and the request helpers, and read best side by side.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc

from client import MAX_MESSAGE_BYTES
from client.protocol import channel_options, text_request
from protocol import grpc_service_pb2 as pb
from protocol import grpc_service_pb2_grpc as pb_grpc
from tools.loadtest.corpus import load_corpus
from tools.stress import nonsense, rawh1, rawh2
from tools.stress.config import StressConfig
from tools.stress.result import UNANSWERED, Tally
from tools.stress.streams import STREAM_RECYCLED, StreamSender

SERVICE = "/inference.GRPCInferenceService/"
MODEL_INFER = f"{SERVICE}ModelInfer"
GARBAGE_METHODS = tuple(
    f"{SERVICE}{name}"
    for name in (
        "ModelInfer",
        "ModelMetadata",
        "ModelReady",
        "ModelConfig",
        "ModelStatistics",
        "RepositoryIndex",
        "ServerMetadata",
        "NoSuchMethod",
    )
)
HUGE_TEXT_CHARS = 100_000
HUGE_BATCHES = (64, 8, 1)
"""Texts per huge-text request, in turn: far past, near and under a few-MiB message limit."""
READY_TIMEOUT_S = 30.0
OVERSIZED_TEXTS = 64
"""Texts (~200-word passages, 256 tokens each once truncated) per oversized-answer request: as JSON, every
output of 64 x 256 tokens x 384 values is ~100 MB; raw, last_hidden_state alone 24 MiB."""
OVERSIZED_DEADLINE_S = 2.0
"""Deadline of the oversized phase's gRPC requests: a refusal takes milliseconds, a run of 64 x 256 tokens seconds."""
BIG_ANSWER_TEXTS = 32
"""Texts per gRPC request of the slow readers with big answers: last_hidden_state of 32 x 256 x 384 is 12 MiB raw."""
BIG_JSON_ANSWER_TEXTS = 8
"""Texts per HTTP request of the slow readers: last_hidden_state of 8 x 256 x 384 is 12 MiB as JSON (budgeted at
16 bytes a value), for a quarter of the model's time."""


@dataclass
class StressContext:
    """What every phase needs: the settings, a seeded random source, and what the server told us."""

    config: StressConfig
    rng: random.Random
    queue_bound: int | None
    """The model's queue bound from ModelConfig, when the server reports one."""

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata (the API key)."""
        return self.config.security.metadata()

    def channel_options(self, *, own_connection: bool = False) -> list[tuple[str, object]]:
        """Options of a channel without retries (each attempt counts); `own_connection`: its own TCP connection."""
        options = [*channel_options(self.config.target, MAX_MESSAGE_BYTES), ("grpc.enable_retries", 0)]
        if own_connection:
            options.append(("grpc.use_local_subchannel_pool", 1))
        return options

    def channel(self, *, own_connection: bool = False) -> grpc.aio.Channel:
        """An asyncio channel with those options."""
        return self.config.security.aio_channel(self.config.target, self.channel_options(own_connection=own_connection))

    def text_request(self, corpus: str, texts: int, outputs: Sequence[str] = ("embedding",)) -> pb.ModelInferRequest:
        """A request of `texts` texts drawn from a shipped corpus."""
        return text_request(self.config.model, self.rng.choices(load_corpus(corpus), k=texts), outputs)

    def http_request(self, texts: Sequence[str], outputs: Sequence[dict[str, object]] = ()) -> bytes:
        """A KServe v2 REST infer request of texts (every output, as JSON, unless `outputs` names some)."""
        text_input = {"name": "text", "datatype": "BYTES", "shape": [len(texts)], "data": list(texts)}
        payload: dict[str, object] = {"inputs": [text_input]}
        if outputs:
            payload["outputs"] = list(outputs)
        assert self.config.http_target is not None
        return rawh1.request_bytes(
            "POST",
            f"/v2/models/{self.config.model}/infer",
            self.config.http_target,
            json.dumps(payload).encode(),
            self.config.security.metadata(),
        )


async def outcome_of(call: grpc.aio.UnaryUnaryCall, safety_timeout_s: float) -> str:
    """The call's status name, or UNANSWERED (and the call cancelled) when none came in time."""
    try:
        code = await asyncio.wait_for(call.code(), safety_timeout_s)
    except asyncio.TimeoutError:
        call.cancel()
        return UNANSWERED
    return code.name


async def _ready(channel: grpc.aio.Channel) -> None:
    """Connect before the load starts, so connection setup is not part of a burst."""
    # If it never connects, the calls fail UNAVAILABLE and are counted as such.
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(channel.channel_ready(), READY_TIMEOUT_S)


def _burst_size(context: StressContext, tally: Tally) -> int:
    count = context.config.count(5000, minimum=20)
    if context.queue_bound:
        count = max(count, 3 * context.queue_bound)
        tally.notes.append(f"{count} requests against a queue bound of {context.queue_bound}")
    return count


async def baseline(context: StressContext, tally: Tally) -> None:
    """No load: the probe alone, for reference."""
    await asyncio.sleep(context.config.seconds(2.0))


async def burst_one_channel(context: StressContext, tally: Tally) -> None:
    """Thousands of single-sentence requests at once, all on one HTTP/2 connection."""
    count = _burst_size(context, tally)
    message = context.text_request("short", 1)
    async with context.channel(own_connection=True) as channel:
        await _ready(channel)
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        calls = [stub.ModelInfer(message, metadata=context.metadata) for _ in range(count)]
        safety = context.config.safety_timeout_s
        tally.add_all(await asyncio.gather(*(outcome_of(call, safety) for call in calls)))


async def burst_many_channels(context: StressContext, tally: Tally) -> None:
    """The same burst spread over many connections."""
    count = _burst_size(context, tally)
    channels = [context.channel(own_connection=True) for _ in range(context.config.count(50, minimum=4))]
    tally.notes.append(f"over {len(channels)} connections")
    message = context.text_request("short", 1)
    try:
        await asyncio.gather(*(_ready(channel) for channel in channels))
        stubs = itertools.cycle([pb_grpc.GRPCInferenceServiceStub(channel) for channel in channels])
        calls = [next(stubs).ModelInfer(message, metadata=context.metadata) for _ in range(count)]
        safety = context.config.safety_timeout_s
        tally.add_all(await asyncio.gather(*(outcome_of(call, safety) for call in calls)))
    finally:
        await asyncio.gather(*(channel.close() for channel in channels))


def _huge_text(rng: random.Random) -> str:
    """About HUGE_TEXT_CHARS characters of real prose."""
    passages = load_corpus("long")
    parts: list[str] = []
    length = 0
    while length < HUGE_TEXT_CHARS:
        parts.append(rng.choice(passages))
        length += len(parts[-1]) + 1
    return " ".join(parts)[:HUGE_TEXT_CHARS]


async def huge_texts(context: StressContext, tally: Tally) -> None:
    """Four clients sending requests of many ~100,000-character texts (refused, truncated or served)."""
    texts = [_huge_text(context.rng) for _ in range(4)]
    messages = [
        text_request(context.config.model, [texts[index % len(texts)] for index in range(batch)])
        for batch in HUGE_BATCHES
    ]
    total = context.config.count(40, minimum=len(HUGE_BATCHES))
    stop_at = asyncio.get_running_loop().time() + context.config.seconds(60.0, minimum=5.0)
    numbers = itertools.count()
    tally.notes.append(f"batches of {'/'.join(map(str, HUGE_BATCHES))} texts of {HUGE_TEXT_CHARS} characters")

    async def client(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
        while (number := next(numbers)) < total and asyncio.get_running_loop().time() < stop_at:
            call = stub.ModelInfer(messages[number % len(messages)], metadata=context.metadata)
            tally.add(await outcome_of(call, context.config.safety_timeout_s))

    channels = [context.channel(own_connection=True) for _ in range(4)]
    try:
        await asyncio.gather(*(client(pb_grpc.GRPCInferenceServiceStub(channel)) for channel in channels))
    finally:
        await asyncio.gather(*(channel.close() for channel in channels))


async def deadline_storm(context: StressContext, tally: Tally) -> None:
    """Waves of requests with 1-50 ms to live: half as gRPC deadlines, half as Triton's `timeout` parameter."""
    total = context.config.count(3000, minimum=20)
    wave = context.config.count(500, minimum=10)
    base = context.text_request("long", 4)
    rng = context.rng
    safety = context.config.safety_timeout_s
    async with context.channel() as channel:
        await _ready(channel)
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for first in range(0, total, wave):
            calls = []
            for number in range(first, min(total, first + wave)):
                if number % 2 == 0:
                    calls.append(stub.ModelInfer(base, timeout=rng.uniform(0.001, 0.05), metadata=context.metadata))
                else:
                    message = pb.ModelInferRequest()
                    message.CopyFrom(base)
                    message.parameters["timeout"].int64_param = rng.randrange(1_000, 50_000)
                    calls.append(stub.ModelInfer(message, metadata=context.metadata))
            tally.add_all(await asyncio.gather(*(outcome_of(call, safety) for call in calls)))


async def cancellation(context: StressContext, tally: Tally) -> None:
    """Requests of 16 long texts, each cancelled by its client 0-30 ms after it was sent."""
    total = context.config.count(1000, minimum=20)
    in_flight = asyncio.Semaphore(context.config.count(100, minimum=10))
    message = context.text_request("long", 16)
    delays = [context.rng.uniform(0.0, 0.03) for _ in range(total)]

    async def cancelled_after(stub: pb_grpc.GRPCInferenceServiceStub, delay_s: float) -> str:
        async with in_flight:
            call = stub.ModelInfer(message, metadata=context.metadata)
            await asyncio.sleep(delay_s)
            call.cancel()  # a no-op once it was answered
            return await outcome_of(call, context.config.safety_timeout_s)

    async with context.channel() as channel:
        await _ready(channel)
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        tally.add_all(await asyncio.gather(*(cancelled_after(stub, delay) for delay in delays)))


async def _raw_outcomes(work: Awaitable[list[str]], streams: int) -> list[str]:
    """A raw connection's outcomes, or for each of its streams when it could not even connect.

    UNANSWERED: no connection or handshake within the safety timeout; UNAVAILABLE: refused.
    """
    try:
        return await work
    except asyncio.TimeoutError:
        return [UNANSWERED] * streams
    except OSError:
        return ["UNAVAILABLE"] * streams


async def slow_readers(context: StressContext, tally: Tally) -> None:
    """Connections that ask for large outputs (last_hidden_state) and never open their flow-control window."""
    address = rawh2.split_target(context.config.target)
    if address is None:
        tally.notes.append("skipped: needs a host:port target")
        return
    connections = context.config.count(16, minimum=2)
    streams = 4
    hold_s = context.config.seconds(10.0)
    # 8 passages of ~200 words: a response of 8 x 256 x hidden floats (3 MiB at 384) for little compute.
    messages = [
        context.text_request("long", 8, outputs=("last_hidden_state",)).SerializeToString() for _ in range(streams)
    ]
    tally.notes.append(f"{connections} connections x {streams} calls held {hold_s:g} s with a zero window")
    host, port = address

    def one_connection() -> Awaitable[list[str]]:
        return rawh2.slow_reader(
            host,
            port,
            context.config.security,
            method=MODEL_INFER,
            messages=messages,
            hold_s=hold_s,
            safety_timeout_s=context.config.safety_timeout_s,
        )

    results = await asyncio.gather(*(_raw_outcomes(one_connection(), streams) for _ in range(connections)))
    for outcomes in results:
        tally.add_all(outcomes)


async def _http_outcomes(work: Awaitable[str]) -> str:
    """An HTTP request's outcome; UNAVAILABLE when it could not even connect (UNANSWERED: not in time)."""
    try:
        return await work
    except asyncio.TimeoutError:
        return UNANSWERED
    except OSError:
        return "UNAVAILABLE"


async def oversized_answers(context: StressContext, tally: Tally) -> None:
    """Requests of 64 long texts whose answers would be ~100 MB as KServe JSON (and 24 MiB as gRPC raw).

    Over the response limit, each is refused once its texts are tokenised, before the model runs.
    The gRPC requests carry a deadline: 24 MiB is within the default 32 MiB limit, and a request the
    server accepts is given up (DEADLINE_EXCEEDED) rather than run in full.
    """
    texts = context.rng.choices(load_corpus("long"), k=OVERSIZED_TEXTS)
    safety = context.config.safety_timeout_s
    grpc_message = text_request(context.config.model, texts, ("last_hidden_state",))
    grpc_total = context.config.count(8, minimum=4)
    grpc_numbers = itertools.count()
    tally.notes.append(
        f"{grpc_total} gRPC requests for last_hidden_state with a {OVERSIZED_DEADLINE_S:g} s deadline, 4 at a time"
    )

    async def grpc_client(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
        while next(grpc_numbers) < grpc_total:
            call = stub.ModelInfer(grpc_message, timeout=OVERSIZED_DEADLINE_S, metadata=context.metadata)
            tally.add(await outcome_of(call, safety))

    address = None if context.config.http_target is None else rawh2.split_target(context.config.http_target)
    http_total = context.config.count(40, minimum=4)
    http_numbers = itertools.count()
    if address is None:
        tally.notes.append("HTTP skipped: no --http-target")
    else:
        http_message = context.http_request(texts)
        tally.notes.append(f"{http_total} KServe REST requests of every output as JSON, 4 at a time")

    async def http_client() -> None:
        while address is not None and next(http_numbers) < http_total:
            work = rawh1.status(*address, context.config.security, http_message, safety_timeout_s=safety)
            tally.add(await _http_outcomes(work))

    channels = [context.channel(own_connection=True) for _ in range(4)]
    try:
        await asyncio.gather(
            *(grpc_client(pb_grpc.GRPCInferenceServiceStub(channel)) for channel in channels),
            *(http_client() for _ in range(4)),
        )
    finally:
        await asyncio.gather(*(channel.close() for channel in channels))


async def slow_readers_big_answers(context: StressContext, tally: Tally) -> None:
    """Clients that ask for 12 MiB answers (last_hidden_state, raw or JSON) and never read them, past the budget.

    All are sent at once, so the server's answer budget is reserved (on admission, before the model
    runs) by the first ones and refuses the rest. Each client leaves at the end of its hold, which
    cancels what the server has not answered yet (PENDING): the model's time is bounded by the hold.
    """
    safety = context.config.safety_timeout_s
    hold_s = context.config.seconds(10.0)
    works: list[Awaitable[list[str]]] = []
    address = rawh2.split_target(context.config.target)
    if address is None:
        tally.notes.append("gRPC skipped: needs a host:port target")
    else:
        connections, streams = context.config.count(16, minimum=2), 2
        messages = [
            context.text_request("long", BIG_ANSWER_TEXTS, outputs=("last_hidden_state",)).SerializeToString()
            for _ in range(streams)
        ]
        tally.notes.append(f"gRPC: {connections} connections x {streams} calls with a zero window, held {hold_s:g} s")
        for _ in range(connections):
            reader = rawh2.slow_reader(
                *address,
                context.config.security,
                method=MODEL_INFER,
                messages=messages,
                hold_s=hold_s,
                safety_timeout_s=safety,
                leave_after_hold=True,
            )
            works.append(_raw_outcomes(reader, streams))
    address = None if context.config.http_target is None else rawh2.split_target(context.config.http_target)
    if address is None:
        tally.notes.append("HTTP skipped: no --http-target")
    else:
        readers = context.config.count(16, minimum=2)
        texts = context.rng.choices(load_corpus("long"), k=BIG_JSON_ANSWER_TEXTS)
        message = context.http_request(texts, [{"name": "last_hidden_state"}])
        tally.notes.append(f"HTTP/1.1: {readers} JSON answers, status line read, held {hold_s:g} s")
        for _ in range(readers):
            reader = rawh1.status(
                *address,
                context.config.security,
                message,
                safety_timeout_s=safety,
                hold_s=hold_s,
                leave_after_hold=True,
            )
            works.append(_as_list(_http_outcomes(reader)))
    for outcomes in await asyncio.gather(*works):
        tally.add_all(outcomes)


async def stream_recycle(context: StressContext, tally: Tally) -> None:
    """A ModelStreamInfer stream kept sending past the server's connection age: reopened, every request answered."""
    duration_s = context.config.stream_seconds or context.config.seconds(20.0, minimum=2.0)
    options = context.channel_options(own_connection=True)
    with context.config.security.channel(context.config.target, options) as channel:
        sender = StreamSender(
            pb_grpc.GRPCInferenceServiceStub(channel),
            context.config.model,
            context.metadata,
            context.rng,
            safety_timeout_s=context.config.safety_timeout_s,
            tally=tally,
        )
        await asyncio.to_thread(sender.run, time.monotonic() + duration_s)
    tally.notes.append(
        f"{duration_s:g} s on {sender.streams} streams, {sender.recycled} ended by the server to be reopened;"
        f" {sender.resent} requests sent again"
    )
    if sender.first_error is not None:
        tally.notes.append(f"first error answer: {' '.join(sender.first_error.split())[:200]}")


async def malformed(context: StressContext, tally: Tally) -> None:
    """Bytes that are not protobuf, protobuf that is nonsense, damaged requests, and non-HTTP/2 connections."""
    rng = context.rng
    safety = context.config.safety_timeout_s
    in_flight = asyncio.Semaphore(50)
    garbage = [(rng.choice(GARBAGE_METHODS), nonsense.garbage_bytes(rng)) for _ in range(context.config.count(400, 10))]
    damaged = [
        (MODEL_INFER, nonsense.flipped_bytes(rng, context.config.model)) for _ in range(context.config.count(100, 5))
    ]
    senseless = [
        (MODEL_INFER, nonsense.nonsense_request(rng, context.config.model).SerializeToString())
        for _ in range(context.config.count(400, 10))
    ]
    tally.notes.append(f"{len(garbage)} garbage, {len(damaged)} damaged, {len(senseless)} nonsense messages")

    async def send(channel: grpc.aio.Channel, method: str, payload: bytes) -> str:
        async with in_flight:
            # No serializers: the bytes go out as they are.
            call = channel.unary_unary(method)(payload, metadata=context.metadata)
            return await outcome_of(call, safety)

    async with context.channel() as channel:
        await _ready(channel)
        messages = [*garbage, *damaged, *senseless]
        tally.add_all(await asyncio.gather(*(send(channel, method, payload) for method, payload in messages)))
    address = rawh2.split_target(context.config.target)
    if address is None:
        return
    for _ in range(context.config.count(20, minimum=1)):
        payload = rng.randbytes(rng.randrange(24, 512))
        work = rawh2.garbage_connection(*address, context.config.security, payload, safety)
        tally.add_all(await _raw_outcomes(_as_list(work), 1))


async def _as_list(work: Awaitable[str]) -> list[str]:
    return [await work]


async def burst_after(context: StressContext, tally: Tally) -> None:
    """The many-connection burst again: the queue bound must still bind after everything above."""
    await burst_many_channels(context, tally)


async def final_request(context: StressContext, tally: Tally) -> None:
    """One ordinary request after everything else: it must succeed."""
    async with context.channel() as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        call = stub.ModelInfer(context.text_request("short", 1), timeout=30.0, metadata=context.metadata)
        tally.add(await outcome_of(call, context.config.safety_timeout_s))


@dataclass(frozen=True)
class Phase:
    """A named phase, what it does, the outcomes it may produce, and how it runs."""

    name: str
    allowed: frozenset[str]
    run: Callable[[StressContext, Tally], Awaitable[None]]

    @property
    def description(self) -> str:
        """The first line of the phase function's docstring."""
        return (self.run.__doc__ or "").strip().splitlines()[0]


_REJECTED = {"OK", "RESOURCE_EXHAUSTED"}
PHASES = (
    Phase("baseline", frozenset(), baseline),
    Phase("burst_one_channel", frozenset(_REJECTED), burst_one_channel),
    Phase("burst_many_channels", frozenset(_REJECTED), burst_many_channels),
    Phase("huge_texts", frozenset({*_REJECTED, "INVALID_ARGUMENT"}), huge_texts),
    Phase("deadline_storm", frozenset({*_REJECTED, "DEADLINE_EXCEEDED"}), deadline_storm),
    Phase("cancellation", frozenset({*_REJECTED, "CANCELLED"}), cancellation),
    Phase("slow_readers", frozenset({rawh2.HELD, rawh2.REFUSED, rawh2.RESET, rawh2.CLOSED}), slow_readers),
    Phase("oversized_answers", frozenset({*_REJECTED, "DEADLINE_EXCEEDED", "HTTP 413", "HTTP 429"}), oversized_answers),
    Phase(
        "slow_readers_big_answers",
        frozenset({rawh2.HELD, rawh2.REFUSED, rawh2.RESET, rawh2.CLOSED, rawh2.PENDING, "HTTP 200", "HTTP 429"}),
        slow_readers_big_answers,
    ),
    Phase("stream_recycle", frozenset({"OK", STREAM_RECYCLED}), stream_recycle),
    Phase(
        "malformed",
        frozenset({*_REJECTED, "INVALID_ARGUMENT", "NOT_FOUND", "UNIMPLEMENTED", "DEADLINE_EXCEEDED", rawh2.CLOSED}),
        malformed,
    ),
    Phase("burst_after", frozenset(_REJECTED), burst_after),
)
FINAL = Phase("final_request", frozenset({"OK"}), final_request)
PHASE_NAMES = tuple(phase.name for phase in PHASES)
