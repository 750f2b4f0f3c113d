"""OpenAI's embeddings API on the HTTP port, driven by the `openai` SDK itself (and raw HTTP for what it cannot send).

The served embeddings are checked against the gRPC port's and, for the default model, against
sentence-transformers; `usage` against an independent count with the `tokenizers` library.
"""

from __future__ import annotations

import base64
import http.client
import json
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
import tritonclient.grpc as triton
from sentence_transformers import SentenceTransformer
from tokenizers import Tokenizer

from export.gate.cases import read_sentences
from service.core.fidelity import cosines, required_cosine
from tests.conftest import DEFAULT_MODEL, TINY_MODEL
from tests.servers import (
    RunningServer,
    metric_samples,
    metric_value,
    start_server,
    wait_for_metric,
    wait_for_queue_depth,
)

SENTENCES = ["A man is eating food.", "The new movie is awesome.", "Ein Hund läuft über die Wiese 🐕."]
LABELS = {"model": TINY_MODEL, "version": "1"}


def sdk(server: RunningServer, **options: object) -> openai.OpenAI:
    """The OpenAI SDK pointed at the server; no retries, so a test sees the first answer."""
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, **options)


def post(server: RunningServer, path: str, body: bytes, content_type: str = "application/json") -> tuple[int, dict]:
    """A raw POST (for bodies the SDK would never send): the status and the JSON answer."""
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    try:
        connection.request("POST", path, body, {"Content-Type": content_type})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def grpc_embeddings(server: RunningServer, texts: list[str]) -> np.ndarray:
    client = triton.InferenceServerClient(server.target)
    tensor = triton.InferInput("text", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([text.encode() for text in texts], dtype=object))
    result = client.infer(TINY_MODEL, [tensor], outputs=[triton.InferRequestedOutput("embedding")])
    return result.as_numpy("embedding")


def test_float_and_base64_answers_carry_the_same_embeddings_as_grpc(tiny_server: RunningServer) -> None:
    client = sdk(tiny_server)
    as_floats = client.embeddings.create(model=TINY_MODEL, input=SENTENCES, encoding_format="float")
    # The SDK asks for base64 when no format is given, and decodes it itself.
    as_base64 = client.embeddings.create(model=TINY_MODEL, input=SENTENCES)
    assert [item.index for item in as_floats.data] == [0, 1, 2]
    assert as_floats.model == as_base64.model == TINY_MODEL
    floats = np.array([item.embedding for item in as_floats.data], dtype=np.float32)
    decoded = np.array([item.embedding for item in as_base64.data], dtype=np.float32)
    np.testing.assert_array_equal(floats, decoded)  # float JSON round-trips float32 exactly
    np.testing.assert_allclose(floats, grpc_embeddings(tiny_server, SENTENCES), atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(floats, axis=1), 1.0, atol=1e-5)


def test_http_inferences_count_with_every_protocols_and_on_their_own(tiny_server: RunningServer) -> None:
    before = metric_samples(tiny_server)
    sdk(tiny_server).embeddings.create(model=TINY_MODEL, input=SENTENCES[:2])
    grpc_embeddings(tiny_server, SENTENCES[:1])
    after = metric_samples(tiny_server)

    def grew(name: str, **labels: str) -> float:
        return metric_value(after, name, **labels) - metric_value(before, name, **labels)

    assert grew("encoder_requests_total", code="OK", **LABELS) == 2  # one over HTTP, one over gRPC
    assert grew("encoder_sequences_total", **LABELS) == 3
    assert grew("encoder_http_requests_total", route="/v1/embeddings", status="200") == 1


def test_base64_is_little_endian_float32(tiny_server: RunningServer) -> None:
    status, answer = post(
        tiny_server, "/v1/embeddings", json.dumps({"model": TINY_MODEL, "input": "one", "encoding_format": "base64"})
    )
    assert status == 200
    vector = np.frombuffer(base64.b64decode(answer["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vector, grpc_embeddings(tiny_server, ["one"])[0], atol=1e-6)


def test_usage_counts_the_model_tokenizers_tokens(tiny_server: RunningServer, tiny_repository: Path) -> None:
    tokenizer = Tokenizer.from_file(str(tiny_repository / TINY_MODEL / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    expected = sum(len(tokenizer.encode(text).ids) for text in SENTENCES)  # [CLS] and [SEP] included
    usage = sdk(tiny_server).embeddings.create(model=TINY_MODEL, input=SENTENCES).usage
    assert usage.prompt_tokens == usage.total_tokens == expected


def test_a_single_string_and_the_openai_options_the_model_can_honour(tiny_server: RunningServer) -> None:
    answer = sdk(tiny_server).embeddings.create(model=TINY_MODEL, input="alone", dimensions=32, user="someone")
    assert len(answer.data) == 1 and len(answer.data[0].embedding) == 32


def test_models_are_listed_and_retrieved(tiny_server: RunningServer) -> None:
    client = sdk(tiny_server)
    assert [model.id for model in client.models.list()] == [TINY_MODEL]
    card = client.models.retrieve(TINY_MODEL)
    assert (card.id, card.owned_by) == (TINY_MODEL, "encoder-serve")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_errors_are_openai_error_objects_with_the_right_status(tiny_server: RunningServer) -> None:
    client = sdk(tiny_server)
    with pytest.raises(openai.NotFoundError, match="unknown model 'no-such-model'") as unknown:
        client.embeddings.create(model="no-such-model", input="text")
    assert unknown.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="gives 32 dimensions and cannot give 8"):
        client.embeddings.create(model=TINY_MODEL, input="text", dimensions=8)
    with pytest.raises(openai.BadRequestError, match="token arrays are not accepted"):
        client.embeddings.create(model=TINY_MODEL, input=[[101, 2023, 102]])
    with pytest.raises(openai.BadRequestError, match=r"input text\[1\] is empty"):
        client.embeddings.create(model=TINY_MODEL, input=["fine", " "])
    # The server goes on serving.
    assert len(client.embeddings.create(model=TINY_MODEL, input="still here").data) == 1


def test_default_model_embeddings_equal_sentence_transformers(
    default_server: RunningServer, default_folder: Path
) -> None:
    sentences = read_sentences()
    expected = SentenceTransformer(str(default_folder), device="cpu").encode(sentences, convert_to_numpy=True)
    with urllib.request.urlopen(f"{default_server.http_url}/v2/models/{DEFAULT_MODEL}/config", timeout=30) as answer:
        variant = json.loads(answer.read())["parameters"]["variant"]["string_value"]
    assert variant == "fp32"  # the default on a CPU
    client = sdk(default_server)
    served = np.array(
        [
            item.embedding
            for start in range(0, len(sentences), 16)
            for item in client.embeddings.create(model=DEFAULT_MODEL, input=sentences[start : start + 16]).data
        ],
        dtype=np.float32,
    )
    assert served.shape == expected.shape
    similarity = cosines(served, expected)
    assert similarity.min() >= required_cosine("fp32", chosen_by_default=True), sentences[int(similarity.argmin())]
    np.testing.assert_allclose(served, expected, atol=1e-4)


@pytest.fixture(scope="module")
def limited_server(tiny_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    flags = (
        "--max-text-bytes", "40",
        "--max-request-text-bytes", "100",
        "--max-embedding-inputs", "4",
        "--max-message-bytes", "2000",
    )  # fmt: skip
    with start_server(tiny_repository, tmp_path_factory.mktemp("limited") / "server.log", *flags) as server:
        yield server


@pytest.mark.parametrize(
    ("texts", "reason", "message"),
    [
        (["x" * 41], "text_too_large", "over the limit of 40 bytes per text"),
        (["x" * 30] * 4, "request_text_too_large", "over the limit of 100 bytes per request"),
        (["x"] * 5, "too_many_inputs", "5 inputs, over the limit of 4 per request"),
        (["x" * 39] * 60, "message_too_large", "over the limit of 2000 bytes"),
    ],
)
def test_limits_answer_413_naming_the_limit(
    limited_server: RunningServer, texts: list[str], reason: str, message: str
) -> None:
    before = metric_value(metric_samples(limited_server), "encoder_requests_rejected_total", reason=reason)
    with pytest.raises(openai.APIStatusError, match=message) as refused:
        sdk(limited_server).embeddings.create(model=TINY_MODEL, input=texts)
    assert refused.value.status_code == 413
    assert refused.value.body["code"] == reason
    after = metric_value(metric_samples(limited_server), "encoder_requests_rejected_total", reason=reason)
    assert after == before + 1
    assert len(sdk(limited_server).embeddings.create(model=TINY_MODEL, input="fits").data) == 1
    assert " ERROR " not in limited_server.log()


BATCH_ROWS = 3
HOLD = ("--max-queue-delay-us", "600000000", "--max-batch-size", str(BATCH_ROWS), "--max-queue-size", "2")
"""Requests wait 600 s for a fuller batch: a test decides when they leave, never a clock."""


@pytest.fixture(scope="module")
def held_server(tiny_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with start_server(tiny_repository, tmp_path_factory.mktemp("held") / "server.log", *HOLD) as server:
        yield server


def send_and_leave_open(server: RunningServer, text: str) -> socket.socket:
    """An embeddings request written whole on a raw connection whose answer is not read."""
    body = json.dumps({"model": TINY_MODEL, "input": text}).encode()
    head = (
        f"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    connection = socket.create_connection(("127.0.0.1", server.http_port), timeout=30)
    connection.sendall(head.encode() + body)
    return connection


def test_a_full_queue_answers_429_and_a_client_that_leaves_takes_its_request_with_it(
    held_server: RunningServer,
) -> None:
    before = metric_samples(held_server)
    waiting = [send_and_leave_open(held_server, f"held {index}") for index in range(2)]
    try:
        wait_for_queue_depth(held_server, 2, TINY_MODEL)
        with pytest.raises(openai.RateLimitError, match="queue full") as refused:
            sdk(held_server).embeddings.create(model=TINY_MODEL, input="one too many")
        assert refused.value.body["code"] == "queue_full"
        assert refused.value.response.headers["retry-after"] == "1"
    finally:
        for connection in waiting:
            connection.close()
    # The clients are gone: their requests leave the queue now, not when the batch would have run.
    cancelled = metric_value(before, "encoder_requests_dropped_total", reason="cancelled", **LABELS) + 2
    wait_for_metric(held_server, "encoder_requests_dropped_total", cancelled, reason="cancelled", **LABELS)
    wait_for_queue_depth(held_server, 0, TINY_MODEL)
    after = metric_samples(held_server)
    assert metric_value(after, "encoder_sequences_total", **LABELS) == metric_value(
        before, "encoder_sequences_total", **LABELS
    )
    route = {"route": "/v1/embeddings"}
    assert metric_value(after, "encoder_http_requests_total", status="429", **route) == (
        metric_value(before, "encoder_http_requests_total", status="429", **route) + 1
    )
    assert metric_value(after, "encoder_http_requests_total", status="499", **route) == (
        metric_value(before, "encoder_http_requests_total", status="499", **route) + 2
    )
    assert " ERROR " not in held_server.log()
