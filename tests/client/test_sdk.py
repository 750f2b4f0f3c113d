"""The SDK's every task and option against one real server of embedders, a classifier and a reranker.

References are independent of the client: a prompt is its prefix typed into the text of a model with
no prompts; a Matryoshka width is the full vector's first values renormalised; binary is the sign
bits packed; int8 is what tritonclient gets; classifier logits are the graph run in onnxruntime on
the tokenizer's own encoding (tests/task_models.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from tokenizers import Tokenizer

from client import (
    AsyncEmbeddingClient,
    EmbeddingClient,
    InvalidRequest,
    ModelNotFound,
    RetryPolicy,
)
from tests.conftest import DEFAULT_MODEL
from tests.servers import RunningServer, start_server
from tests.task_models import (
    BERT_CLASSIFIER,
    EMBEDDER,
    LABELS,
    MATRYOSHKA_DIMENSIONS,
    PROMPTS,
    ROBERTA_RERANKER,
    SENTENCES,
    expected_logits,
    task_repository,
)

QUERY = SENTENCES[0]
TEXTS = list(SENTENCES[1:])


@pytest.fixture(scope="module")
def repository(default_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both classifiers, the prompted embedder, and the default model itself (calibrated: int8 and uint8)."""
    root = task_repository(tmp_path_factory.mktemp("sdk") / "repository", default_repository / DEFAULT_MODEL)
    (root / DEFAULT_MODEL).symlink_to((default_repository / DEFAULT_MODEL).resolve())
    return root


@pytest.fixture(scope="module")
def server(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with start_server(repository, tmp_path_factory.mktemp("sdk-server") / "server.log") as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[EmbeddingClient]:
    with EmbeddingClient(server.target, model=DEFAULT_MODEL, batch_size=2) as blocking:
        yield blocking


def normalised(vectors: np.ndarray) -> np.ndarray:
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def test_discovery_names_models_tasks_prompts_widths_and_labels(client: EmbeddingClient) -> None:
    assert client.models() == sorted([BERT_CLASSIFIER, DEFAULT_MODEL, EMBEDDER, ROBERTA_RERANKER])
    embedder = client.model_info(EMBEDDER)
    assert (embedder.task, embedder.dimension, embedder.prompts) == ("embed", 384, PROMPTS)
    assert embedder.matryoshka_dimensions == MATRYOSHKA_DIMENSIONS and embedder.default_prompt_name == "passage"
    assert client.model_info().embedding_types == ("float", "int8", "uint8", "binary", "ubinary")
    classifier = client.model_info(BERT_CLASSIFIER)
    assert (classifier.task, classifier.labels, classifier.dimension) == ("classify", LABELS[BERT_CLASSIFIER], None)


def test_embed_prompt_dimensions_and_truncate(client: EmbeddingClient) -> None:
    plain = client.embed(TEXTS)  # 3 requests of 2 texts, in order
    assert plain.shape == (len(TEXTS), 384) and plain.dtype == np.float32
    typed_prompt = client.embed([PROMPTS["query"] + text for text in TEXTS])
    np.testing.assert_allclose(client.embed(TEXTS, model=EMBEDDER, prompt_name="query"), typed_prompt, atol=1e-5)
    np.testing.assert_allclose(
        client.embed(TEXTS, model=EMBEDDER), client.embed(TEXTS, model=EMBEDDER, prompt_name="passage"), atol=1e-6
    )
    short = client.embed(TEXTS, model=EMBEDDER, prompt_name="query", dimensions=64)
    np.testing.assert_allclose(short, normalised(typed_prompt[:, :64]), atol=1e-5)
    long_text = " ".join(SENTENCES * 40)  # well past the model's 256 tokens
    whole, cut = client.embed([long_text], truncate=False), client.embed([long_text], truncate=True)
    assert whole.shape == cut.shape == (1, 384) and (whole @ cut.T).item() < 0.9999  # windows, not the first 256 tokens


def test_embedding_types(client: EmbeddingClient, server: RunningServer) -> None:
    floats = client.embed(TEXTS)
    binary = client.embed(TEXTS, embedding_type="binary")
    assert binary.dtype == np.int8 and binary.shape == (len(TEXTS), 48)
    np.testing.assert_array_equal(binary.astype(np.int16) + 128, np.packbits(floats > 0, axis=1))
    np.testing.assert_array_equal(client.embed(TEXTS, embedding_type="ubinary"), np.packbits(floats > 0, axis=1))
    text = triton.InferInput("text", [len(TEXTS)], "BYTES")
    text.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=object))
    with triton.InferenceServerClient(server.target) as reference:
        answer = reference.infer(DEFAULT_MODEL, [text], outputs=[triton.InferRequestedOutput("embedding_int8")])
    int8 = client.embed(TEXTS, embedding_type="int8")
    assert int8.dtype == np.int8
    np.testing.assert_array_equal(int8, answer.as_numpy("embedding_int8"))
    assert client.embed(TEXTS, embedding_type="uint8").dtype == np.uint8
    with pytest.raises(ValueError, match="embedding_type"):
        client.embed(TEXTS, embedding_type="fp16")


def test_rerank_sorts_documents_by_the_rerankers_probability(client: EmbeddingClient, repository: Path) -> None:
    logits = expected_logits(repository / ROBERTA_RERANKER, [(QUERY, text) for text in TEXTS])[:, 0]
    ranking = client.rerank(QUERY, TEXTS, model=ROBERTA_RERANKER)
    order = np.argsort(-logits, kind="stable")
    np.testing.assert_array_equal(ranking.indices, order)
    np.testing.assert_allclose(ranking.scores, 1 / (1 + np.exp(-logits[order])), atol=1e-5)
    top = client.rerank(QUERY, TEXTS, model=ROBERTA_RERANKER, top_n=2, raw_scores=True)
    np.testing.assert_array_equal(top.indices, order[:2])
    np.testing.assert_allclose(top.scores, logits[order[:2]], atol=1e-5)
    with pytest.raises(ValueError, match="3 labels"):
        client.rerank(QUERY, TEXTS, model=BERT_CLASSIFIER)


def test_classify_texts_and_pairs(client: EmbeddingClient, repository: Path) -> None:
    folder = repository / BERT_CLASSIFIER
    single = client.classify(TEXTS, model=BERT_CLASSIFIER)
    logits = expected_logits(folder, [(text,) for text in TEXTS])
    probabilities = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(single.scores, probabilities, atol=1e-5)
    assert single.labels == [LABELS[BERT_CLASSIFIER][i] for i in np.argmax(logits, axis=1)]
    pairs = client.classify(TEXTS, model=BERT_CLASSIFIER, pairs_with=[QUERY] * len(TEXTS), raw_scores=True)
    np.testing.assert_allclose(pairs.scores, expected_logits(folder, [(QUERY, t) for t in TEXTS]), atol=1e-5)


def test_tokenize_gives_the_tokens_the_model_reads(client: EmbeddingClient, repository: Path) -> None:
    """Ids and offsets as the model's tokenizer.json gives them for the prompted text; specials have no place."""
    reference = Tokenizer.from_file(str(repository / EMBEDDER / "tokenizer.json"))
    reference.no_padding()
    reference.no_truncation()
    for prompt_name, special in (("query", True), ("passage", False)):
        texts = TEXTS[:3]
        answer = client.tokenize(texts, model=EMBEDDER, prompt_name=prompt_name, add_special_tokens=special)
        assert len(answer) == len(texts)  # two requests of 2 and 1 texts
        for text, tokens in zip(texts, answer, strict=True):
            prompted = PROMPTS[prompt_name] + text
            encoding = reference.encode(prompted, add_special_tokens=special)
            np.testing.assert_array_equal(tokens.ids, encoding.ids)
            marked = np.array(encoding.special_tokens_mask, dtype=bool)
            np.testing.assert_array_equal(tokens.special, marked)
            np.testing.assert_array_equal(tokens.offsets[~marked], np.array(encoding.offsets)[~marked])
            assert len(tokens) == len(encoding.ids) and tokens.special.any() == special
    long_text = " ".join(SENTENCES * 40)
    (cut,), (whole,) = client.tokenize([long_text]), client.tokenize([long_text], truncate=False)
    assert len(cut) == client.model_info().max_sequence_length < len(whole)
    with pytest.raises(InvalidRequest, match="'nope'"):
        client.tokenize(TEXTS, model=EMBEDDER, prompt_name="nope")


def test_refusals_are_typed_carry_the_reason_and_are_not_retried(server: RunningServer) -> None:
    with EmbeddingClient(server.target, model=EMBEDDER) as client:
        with pytest.raises(InvalidRequest) as refused:
            client.embed(TEXTS, prompt_name="nonsense")
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "query" in refused.value.message and "passage" in refused.value.message  # the server's reason
        with pytest.raises(ModelNotFound):
            client.embed(TEXTS, model="no-such-model")
        assert client.retries == 0


async def test_async_client_every_task(server: RunningServer, client: EmbeddingClient) -> None:
    async with AsyncEmbeddingClient(server.target, batch_size=1, connections=2) as concurrent:
        embeddings, ranking, classes, info = await asyncio.gather(
            concurrent.embed(TEXTS, model=EMBEDDER, prompt_name="query", dimensions=128),
            concurrent.rerank(QUERY, TEXTS, model=ROBERTA_RERANKER, top_n=3),
            concurrent.classify(TEXTS, model=BERT_CLASSIFIER),
            concurrent.model_info(EMBEDDER),
        )
        binary = await concurrent.embed(TEXTS, embedding_type="binary")
        tokens = await concurrent.tokenize(TEXTS, model=EMBEDDER)
    np.testing.assert_allclose(
        embeddings, client.embed(TEXTS, model=EMBEDDER, prompt_name="query", dimensions=128), atol=1e-5
    )
    expected = client.rerank(QUERY, TEXTS, model=ROBERTA_RERANKER, top_n=3)
    np.testing.assert_array_equal(ranking.indices, expected.indices)
    np.testing.assert_allclose(ranking.scores, expected.scores, atol=1e-5)
    np.testing.assert_allclose(classes.scores, client.classify(TEXTS, model=BERT_CLASSIFIER).scores, atol=1e-5)
    np.testing.assert_array_equal(binary, client.embed(TEXTS, embedding_type="binary"))
    assert info.prompts == PROMPTS
    for mine, blocking in zip(tokens, client.tokenize(TEXTS, model=EMBEDDER), strict=True):
        np.testing.assert_array_equal(mine.ids, blocking.ids)
        np.testing.assert_array_equal(mine.offsets, blocking.offsets)


def own_connections_to(port: int) -> set[int]:
    """This process's TCP connections in ESTABLISHED state towards `port`: their sockets' inodes.

    Only sockets this process holds (its /proc/self/fd) count, so other processes' connections to the port
    (the suite's other clients, other test runs on the machine) do not.
    """
    own = set()
    for descriptor in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):  # closed meanwhile
            target = os.readlink(descriptor)
            if target.startswith("socket:["):
                own.add(int(target[len("socket:[") : -1]))
    connected = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            remote, state, inode = fields[2], fields[3], int(fields[9])
            if state == "01" and int(remote.rsplit(":", 1)[1], 16) == port and inode in own:
                connected.add(inode)
    return connected


@pytest.mark.parametrize("connections", [1, 3])
def test_each_connection_is_its_own_tcp_connection(server: RunningServer, connections: int) -> None:
    before = own_connections_to(server.grpc_port)
    with EmbeddingClient(server.target, connections=connections, retry=RetryPolicy(max_attempts=1)) as client:
        for _ in range(2 * connections):  # round-robin: every channel gets calls
            client.embed(TEXTS[:1])
        opened = own_connections_to(server.grpc_port) - before
    assert len(opened) == connections


def test_a_priority_is_sent_and_checked_by_the_server(server: RunningServer) -> None:
    with EmbeddingClient(server.target, model=EMBEDDER) as client:
        levels = client.model_info().priority_levels
        assert levels == 2  # the server's default: 1 for queries, 2 for bulk work
        assert client.embed(TEXTS, priority=levels).shape[0] == len(TEXTS)
        with pytest.raises(InvalidRequest, match="priority must be an integer from 1 \\(the highest\\) to 2"):
            client.embed(TEXTS, priority=levels + 1)
