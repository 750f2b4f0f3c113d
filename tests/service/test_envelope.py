"""The request envelope: counting after the answer is encoded, the answer budget, failures; the status tables."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
from prometheus_client import REGISTRY

from service import envelope
from service.envelope import Envelope
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
from service.frontends.grpc.status import status_of
from service.frontends.http.errors import STATUS as HTTP_STATUS
from service.frontends.http.errors import MethodNotAllowed, UnsupportedMediaType, http_status
from service.ops.settings import Settings
from service.ops.tenants import Tenant, TenantLimits
from service.pipeline.api import DecodeRequest, InferenceRequest, InputTensor, Pipeline, TokenizeRequest
from tests.conftest import TINY_MODEL


def _requests(code: str) -> float:
    labels = {"model": TINY_MODEL, "version": "1", "code": code}
    return REGISTRY.get_sample_value("encoder_requests_total", labels) or 0.0


def _rejected(reason: str) -> float:
    return REGISTRY.get_sample_value("encoder_requests_rejected_total", {"reason": reason}) or 0.0


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
    async with door.inference(envelope.stamp(), _text("counted when encoded")) as inference:
        assert _requests("OK") == before_ok  # the rows are back, the answer not yet encoded: not counted
        encoded = await inference.encode(inference.result.outputs["embedding"].tobytes)
    assert len(encoded) == 32 * 4
    assert (_requests("OK"), _requests("INTERNAL")) == (before_ok + 1, before_internal)
    assert door.pipeline.answers.in_flight_bytes == inference.result.answer_bytes > 0
    door.answered(inference.result)
    assert door.pipeline.answers.in_flight_bytes == 0


async def test_an_answer_that_fails_to_encode_counts_as_a_failure_and_leaves_the_budget(tiny_repository: Path) -> None:
    async with serving(tiny_repository) as door:
        await _failed_encoding(door)


async def _failed_encoding(door: Envelope) -> None:
    before_ok, before_internal = _requests("OK"), _requests("INTERNAL")

    def broken() -> bytes:
        raise ValueError("the encoder broke")

    with pytest.raises(ValueError, match="the encoder broke"):
        async with door.inference(envelope.stamp(), _text("never answered")) as inference:
            await inference.encode(broken)
    assert (_requests("OK"), _requests("INTERNAL")) == (before_ok, before_internal + 1)
    assert door.pipeline.answers.in_flight_bytes == 0


async def test_failed_counts_refusals_by_reason_once_and_hides_what_nobody_planned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    before = _rejected("queue_full")
    refusal = Overloaded("queue full", "queue_full")
    assert Envelope.failed(refusal, "a test") is refusal
    assert _rejected("queue_full") == before + 1
    unplanned = Envelope.failed(KeyError("secret detail"), "a test request")
    assert unplanned.kind is Kind.INTERNAL and str(unplanned) == INTERNAL_MESSAGE
    assert "unhandled error answering a test request" in caplog.text and "secret detail" in caplog.text


def test_authentication_notes_the_tenant_or_refuses_with_the_protocols_hint() -> None:
    class Keys:
        def tenant(self, authorization: str | None) -> str | None:
            return "team-a" if authorization == "Bearer good" else None

    door = Envelope(Pipeline(Settings(model_repository=Path("."))), api_keys=Keys())
    context = envelope.stamp()
    door.authenticate(context, "Bearer good", "send it")
    assert context.tenant == "team-a"
    with pytest.raises(Unauthenticated, match="missing or unknown API key: send it this way") as refused:
        door.authenticate(envelope.stamp(), "Bearer bad", "send it this way")
    assert refused.value.reason == "unauthenticated"


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
    context = envelope.stamp()
    context.tenant = tenant
    before_ok = _requests("OK")
    async with door.inference(context, TokenizeRequest(TINY_MODEL, [b"one two three"])) as tokenized:
        assert _requests("OK") == before_ok  # counted once its answer is written
        body = await tokenized.write(lambda: repr([token.id for token in tokenized.result.tokens[0]]).encode())
    assert _requests("OK") == before_ok + 1
    assert door.pipeline.answers.in_flight_bytes == tokenized.result.answer_bytes == len(body)  # held until sent
    door.answered(tokenized.result)
    assert door.pipeline.answers.in_flight_bytes == 0
    async with door.inference(context, DecodeRequest(TINY_MODEL, [[5, 6], [7]])) as decoded:
        await decoded.write(lambda: "|".join(decoded.result.texts).encode())
    door.answered(decoded.result)
    assert _requests("OK") == before_ok + 2
    charged = REGISTRY.get_sample_value("encoder_tenant_prompt_tokens_total", {"tenant": "tokenizer-calls"})
    assert charged == tokenized.result.prompt_tokens + 3 == 5 + 3  # [CLS] one two three [SEP], then 3 ids
    before_invalid = _requests("INVALID_ARGUMENT")
    with pytest.raises(InvalidArgument, match="token id 1000000 is not in the tokenizer's vocabulary"):
        async with door.inference(context, DecodeRequest(TINY_MODEL, [[10**6]])):
            pass
    assert _requests("INVALID_ARGUMENT") == before_invalid + 1
