"""The stress suite's phases: each sends a bounded amount of hostile load and tallies every outcome.

Every request has an outcome: its gRPC status name, or UNANSWERED when no response came within
the safety timeout (the request is then cancelled). Requests are sent without a gRPC deadline,
except where deadlines are the point, so that a server which never answers is seen as such
rather than hidden behind the client's own DEADLINE_EXCEEDED. Each phase is bounded in count,
and in time by its counts and the safety timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc

from client import MAX_MESSAGE_BYTES
from client.loadtest.corpus import load_corpus
from client.protocol import channel_options, text_request
from client.stress import nonsense, rawh2
from client.stress.config import StressConfig
from client.stress.result import UNANSWERED, Tally
from service.proto import grpc_service_pb2 as pb
from service.proto import grpc_service_pb2_grpc as pb_grpc

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

    def channel(self, *, own_connection: bool = False) -> grpc.aio.Channel:
        """A channel without retries (each attempt counts); `own_connection` gives it its own TCP connection."""
        options = [*channel_options(self.config.target, MAX_MESSAGE_BYTES), ("grpc.enable_retries", 0)]
        if own_connection:
            options.append(("grpc.use_local_subchannel_pool", 1))
        return self.config.security.aio_channel(self.config.target, options)

    def text_request(self, corpus: str, texts: int, outputs: Sequence[str] = ("embedding",)) -> pb.ModelInferRequest:
        """A request of `texts` texts drawn from a shipped corpus."""
        return text_request(self.config.model, self.rng.choices(load_corpus(corpus), k=texts), outputs)


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
    Phase(
        "malformed",
        frozenset({*_REJECTED, "INVALID_ARGUMENT", "NOT_FOUND", "UNIMPLEMENTED", "DEADLINE_EXCEEDED", rawh2.CLOSED}),
        malformed,
    ),
    Phase("burst_after", frozenset(_REJECTED), burst_after),
)
FINAL = Phase("final_request", frozenset({"OK"}), final_request)
PHASE_NAMES = tuple(phase.name for phase in PHASES)
