"""The request envelope: counting after the answer is encoded, the answer budget, spans, failures; the status tables."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import REGISTRY

from service.envelope import Envelope, RequestEnvelope, failed
from service.errors import (
    INTERNAL_MESSAGE,
    DeadlineExceeded,
    InvalidArgument,
    Kind,
    ModelFailure,
    NotFound,
    Overloaded,
    RequestTooLarge,
    ServiceError,
    TooLarge,
    Unauthenticated,
    Unavailable,
    Unimplemented,
    outcome,
)
from service.frontends.grpc.status import STATUS as GRPC_STATUS
from service.frontends.grpc.status import status_number, status_of
from service.frontends.http.errors import STATUS as HTTP_STATUS
from service.frontends.http.errors import MethodNotAllowed, UnsupportedMediaType, http_status
from service.ops import tracing
from service.ops.settings import Settings
from service.ops.tenants import Tenant, TenantLimits
from service.pipeline.api import DecodeRequest, InferenceRequest, InputTensor, Pipeline, TokenizeRequest
from tests.conftest import TINY_MODEL


def _requests(code: str) -> float:
    labels = {"model": TINY_MODEL, "version": "1", "code": code}
    return REGISTRY.get_sample_value("encoder_requests_total", labels) or 0.0


def _rejected(reason: str) -> float:
    return REGISTRY.get_sample_value("encoder_requests_rejected_total", {"reason": reason}) or 0.0


def _opened(door: Envelope, tenant: Tenant | None = None) -> RequestEnvelope:
    """A request's envelope as the gRPC port opens it (no span: tracing is off), for `tenant` if given."""
    request = door.request(None, status_number)
    request.tenant = tenant
    return request


def _text(text: str) -> InferenceRequest:
    return InferenceRequest(TINY_MODEL, inputs=(InputTensor("text", "BYTES", (1,), [text.encode()], raw=False),))


@asynccontextmanager
async def serving(repository: Path) -> AsyncIterator[Envelope]:
    """An envelope over a pipeline serving the tiny model in this process, closed afterwards."""
    pipeline = Pipeline(Settings(model_repository=repository, device="cpu", intra_op_threads=1))
    pipeline.discover()
    await pipeline.load(TINY_MODEL)
    try:
        yield Envelope(pipeline, api_keys=None)
    finally:
        await pipeline.close(5)


async def test_a_request_is_counted_once_its_answer_is_encoded(tiny_repository: Path) -> None:
    async with serving(tiny_repository) as door:
        await _counted_once_encoded(door)


async def _counted_once_encoded(door: Envelope) -> None:
    before_ok, before_internal = _requests("OK"), _requests("INTERNAL")
    request = _opened(door)
    async with request.inference(_text("counted when encoded")) as inference:
        assert _requests("OK") == before_ok  # the rows are back, the answer not yet encoded: not counted
        encoded = await inference.encode(inference.result.outputs["embedding"].tobytes)
    assert len(encoded) == 32 * 4
    assert (_requests("OK"), _requests("INTERNAL")) == (before_ok + 1, before_internal)
    assert door.pipeline.answers.in_flight_bytes == inference.result.answer_bytes > 0  # held until sent
    request.end()
    assert door.pipeline.answers.in_flight_bytes == 0


async def test_an_answer_that_fails_to_encode_counts_as_a_failure_and_leaves_the_budget(tiny_repository: Path) -> None:
    async with serving(tiny_repository) as door:
        await _failed_encoding(door)


async def _failed_encoding(door: Envelope) -> None:
    before_ok, before_internal = _requests("OK"), _requests("INTERNAL")

    def broken() -> bytes:
        raise ValueError("the encoder broke")

    request = _opened(door)
    with pytest.raises(ValueError, match="the encoder broke") as failure:
        async with request.inference(_text("never answered")) as inference:
            await inference.encode(broken)
    assert (_requests("OK"), _requests("INTERNAL")) == (before_ok, before_internal + 1)
    request.end(failure.value)
    assert door.pipeline.answers.in_flight_bytes == 0


async def test_failed_counts_refusals_by_reason_once_and_hides_what_nobody_planned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    before = _rejected("queue_full")
    refusal = Overloaded("queue full", "queue_full")
    assert failed(refusal, "a test") is refusal
    assert _rejected("queue_full") == before + 1
    unplanned = failed(KeyError("secret detail"), "a test request")
    assert unplanned.kind is Kind.INTERNAL and str(unplanned) == INTERNAL_MESSAGE
    assert "unhandled error answering a test request" in caplog.text and "secret detail" in caplog.text


def test_authentication_notes_the_tenant_or_refuses_with_the_protocols_hint() -> None:
    class Keys:
        def tenant(self, authorization: str | None) -> str | None:
            return "team-a" if authorization == "Bearer good" else None

    door = Envelope(Pipeline(Settings(model_repository=Path("."))), api_keys=Keys())
    request = door.request(None, status_number, authorization="Bearer good", send_key="send it")
    assert request.tenant == "team-a"
    with pytest.raises(Unauthenticated, match="missing or unknown API key: send it this way") as refused:
        door.request(None, status_number, authorization="Bearer bad", send_key="send it this way")
    assert refused.value.reason == "unauthenticated"
    assert door.request(None, status_number, authorization="Bearer bad").tenant is None  # an open route


@pytest.mark.parametrize("kind", list(Kind))
def test_every_kind_has_a_grpc_status_named_as_its_outcome_and_an_http_status(kind: Kind) -> None:
    assert GRPC_STATUS[kind] is grpc.StatusCode[kind.outcome]
    assert 400 <= HTTP_STATUS[kind] < 600


@pytest.mark.parametrize(
    ("error", "grpc_status", "http"),
    [
        (InvalidArgument("x"), grpc.StatusCode.INVALID_ARGUMENT, 400),
        (RequestTooLarge("x", "text_too_large"), grpc.StatusCode.INVALID_ARGUMENT, 413),
        (TooLarge("x", "response_too_large"), grpc.StatusCode.RESOURCE_EXHAUSTED, 413),
        (NotFound("x"), grpc.StatusCode.NOT_FOUND, 404),
        (Overloaded("x", "queue_full"), grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (Unavailable("x"), grpc.StatusCode.UNAVAILABLE, 503),
        (DeadlineExceeded("x"), grpc.StatusCode.DEADLINE_EXCEEDED, 504),
        (Unauthenticated("x"), grpc.StatusCode.UNAUTHENTICATED, 401),
        (Unimplemented("x"), grpc.StatusCode.UNIMPLEMENTED, 501),
        (ModelFailure("x"), grpc.StatusCode.INTERNAL, 500),
        (ServiceError("x"), grpc.StatusCode.INTERNAL, 500),
        (MethodNotAllowed("x", ("GET",)), grpc.StatusCode.INVALID_ARGUMENT, 405),
        (UnsupportedMediaType("x"), grpc.StatusCode.INVALID_ARGUMENT, 415),
    ],
)
def test_each_error_maps_through_each_protocols_one_table(
    error: ServiceError, grpc_status: grpc.StatusCode, http: int
) -> None:
    assert status_of(error) is grpc_status
    assert http_status(error) == http
    assert outcome(error) == grpc_status.name


async def test_tokenize_and_decode_run_inside_the_envelope(tiny_repository: Path) -> None:
    async with serving(tiny_repository) as door:
        await _tokenizer_calls(door)


async def _tokenizer_calls(door: Envelope) -> None:
    tenant = Tenant("tokenizer-calls", TenantLimits())

    before_ok = _requests("OK")
    request = _opened(door, tenant)
    async with request.inference(TokenizeRequest(TINY_MODEL, [b"one two three"])) as tokenized:
        assert _requests("OK") == before_ok  # counted once its answer is written
        body = await tokenized.write(lambda: repr([token.id for token in tokenized.result.tokens[0]]).encode())
    assert _requests("OK") == before_ok + 1
    assert door.pipeline.answers.in_flight_bytes == tokenized.result.answer_bytes == len(body)  # held until sent
    request.end()
    assert door.pipeline.answers.in_flight_bytes == 0
    request = _opened(door, tenant)
    async with request.inference(DecodeRequest(TINY_MODEL, [[5, 6], [7]])) as decoded:
        await decoded.write(lambda: "|".join(decoded.result.texts).encode())
    request.end()
    assert _requests("OK") == before_ok + 2
    charged = REGISTRY.get_sample_value("encoder_tenant_prompt_tokens_total", {"tenant": "tokenizer-calls"})
    assert charged == tokenized.result.prompt_tokens + 3 == 5 + 3  # [CLS] one two three [SEP], then 3 ids
    before_invalid = _requests("INVALID_ARGUMENT")
    with pytest.raises(InvalidArgument, match="token id 1000000 is not in the tokenizer's vocabulary"):
        async with _opened(door, tenant).inference(DecodeRequest(TINY_MODEL, [[10**6]])):
            pass
    assert _requests("INVALID_ARGUMENT") == before_invalid + 1


class _CountedReleases:
    """The answer budget's releases, counted: a request's bytes must leave it exactly once."""

    def __init__(self, door: Envelope, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sizes: list[int] = []
        budget = door.pipeline.answers
        release = budget.release

        def counted(size: int) -> None:
            self.sizes.append(size)
            release(size)

        monkeypatch.setattr(budget, "release", counted)


async def test_a_reservation_is_released_once_whatever_the_outcome(
    tiny_repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with serving(tiny_repository) as door:
        releases = _CountedReleases(door, monkeypatch)
        budget = door.pipeline.answers
        for outcome_name in ("answered", "failed while encoding", "cancelled", "client gone"):
            releases.sizes.clear()
            request = _opened(door)
            error: BaseException | None = None
            if outcome_name == "client gone":  # it left before its inference ran: nothing is held for it
                request.end(asyncio.CancelledError())
                with pytest.raises(Unavailable, match="the request ended before its answer was budgeted"):
                    async with request.inference(_text(outcome_name)):
                        pass
                assert (releases.sizes, budget.in_flight_bytes) == ([], 0)
                continue
            try:
                async with request.inference(_text(outcome_name)) as inference:
                    held = inference.result.answer_bytes
                    assert budget.in_flight_bytes == held > 0
                    if outcome_name == "failed while encoding":
                        await inference.encode(lambda: 1 / 0)
                    if outcome_name == "cancelled":
                        raise asyncio.CancelledError
                    await inference.encode(inference.result.outputs["embedding"].tobytes)
            except (ZeroDivisionError, asyncio.CancelledError) as failure:
                error = failure
            assert budget.in_flight_bytes == held  # held until the request ends
            request.end(error)
            request.end()  # a second end changes nothing
            assert (releases.sizes, budget.in_flight_bytes) == ([held], 0), outcome_name


@pytest.fixture
def recorded_spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """Tracing on in this process, its spans kept in memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "ON", True)
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    monkeypatch.setattr(tracing, "_propagator", TraceContextTextMapPropagator())
    yield exporter
    provider.shutdown()


def test_a_stream_messages_span_is_a_child_of_its_streams(recorded_spans: InMemorySpanExporter) -> None:
    trace_id, caller_span = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331
    traceparent = f"00-{trace_id:032x}-{caller_span:016x}-01"
    door = Envelope(Pipeline(Settings(model_repository=Path("."))), api_keys=None)
    span = tracing.rpc_span("ModelStreamInfer", (("traceparent", traceparent),))
    stream = door.request(span, status_number, stream=True)
    stream.tenant = Tenant("streaming", TenantLimits())
    assert stream.trace is None  # the stream itself has no span: each message has one
    first, second = stream.message(None), stream.message(12.5)
    assert (first.tenant, second.tenant, second.deadline) == (stream.tenant, stream.tenant, 12.5)
    first.end()
    second.end(NotFound("unknown model 'x'"))
    stream.end()
    spans = recorded_spans.get_finished_spans()
    assert [span.name for span in spans] == ["inference.GRPCInferenceService/ModelStreamInfer"] * 2
    for span in spans:
        assert (span.parent.trace_id, span.parent.span_id) == (trace_id, caller_span)
        assert span.context.trace_id == trace_id
    assert [span.attributes["rpc.grpc.status_code"] for span in spans] == [0, 5]
    assert [span.status.is_ok for span in spans] == [True, False]
    assert spans[1].status.description == "unknown model 'x'"


def test_a_refusal_at_the_door_ends_the_requests_span_with_its_status(recorded_spans: InMemorySpanExporter) -> None:
    class Keys:
        def tenant(self, authorization: str | None) -> str | None:
            return "team-a" if authorization == "Bearer good" else None

    door = Envelope(Pipeline(Settings(model_repository=Path("."))), api_keys=Keys())

    def too_busy() -> None:
        raise Overloaded("too busy", "http_concurrency")

    with pytest.raises(Overloaded):  # the front end's own refusal comes before the key is read
        door.request(tracing.rpc_span("ModelInfer", ()), status_number, send_key="send it", refuse_first=too_busy)
    with pytest.raises(Unauthenticated):
        door.request(tracing.rpc_span("ModelInfer", ()), status_number, authorization="Bearer bad", send_key="send it")
    accepted = door.request(
        tracing.rpc_span("ModelInfer", ()), status_number, authorization="Bearer good", send_key="-"
    )
    accepted.end()
    accepted.end(Unavailable("ended twice"))  # a second end changes nothing
    spans = recorded_spans.get_finished_spans()
    assert [span.attributes["rpc.grpc.status_code"] for span in spans] == [
        grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
        grpc.StatusCode.UNAUTHENTICATED.value[0],
        grpc.StatusCode.OK.value[0],
    ]
    assert [span.status.description for span in spans] == ["too busy", "missing or unknown API key: send it", None]
