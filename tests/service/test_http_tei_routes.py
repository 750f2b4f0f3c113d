"""text-embeddings-inference's /similarity, /embed_all and /decode over raw HTTP, on one real server.

The repository holds the default embedder beside two tiny classifiers (tests.task_models): one with
its own trained tokenizer, one that takes token ids only. /similarity is checked against the cosines
of the server's own /embed answers and against sentence-transformers reading the model's folder;
/embed_all against sentence-transformers' token embeddings; /decode against the `tokenizers` library
decoding the same ids, and through a round trip with
/tokenize; every malformed body for TEI's error body, a precise status and message.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from sentence_transformers import SentenceTransformer
from tokenizers import Tokenizer

from service.core.repository import P_TOKENIZER, config_text, parse_config
from tests import task_models
from tests.conftest import DEFAULT_MODEL
from tests.servers import RunningServer, metric_samples, metric_value, start_server, wait_for_metric

CLASSIFIER = task_models.BERT_CLASSIFIER
TOKEN_IDS_ONLY = "token-ids-only"
SOURCE = "A man is eating food."
SENTENCES = [
    "A man is eating a piece of bread.",
    "The new movie is awesome.",
    "Ein Hund läuft über die Wiese 🐕.",
    "A man is riding a horse.",
]
SIMILAR = {"inputs": {"source_sentence": SOURCE, "sentences": SENTENCES}}
MAX_INPUTS = 2048
"""--max-embedding-inputs' default: TEI's max_client_batch_size here."""


@pytest.fixture(scope="module")
def repository(default_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default embedder, a classifier with its own tokenizer, and a classifier without a tokenizer."""
    root = tmp_path_factory.mktemp("tei-routes-repository")
    (root / DEFAULT_MODEL).symlink_to(default_repository / DEFAULT_MODEL)
    labels, weights = task_models.LABELS[CLASSIFIER], task_models.WEIGHTS[CLASSIFIER]
    task_models.write_classifier(root / CLASSIFIER, "bert", labels, weights)
    task_models.write_classifier(root / TOKEN_IDS_ONLY, "bert", labels, weights)
    config_path = root / TOKEN_IDS_ONLY / "config.pbtxt"
    config = parse_config(config_path.read_text(), config_path)
    del config.parameters[P_TOKENIZER]
    config_path.write_text(config_text(config))
    return root


@pytest.fixture(scope="module")
def server(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """One server for every test of this module."""
    with start_server(repository, tmp_path_factory.mktemp("tei-routes-server") / "server.log") as running:
        yield running


def post(server: RunningServer, route: str, body: object) -> tuple[int, object]:
    """POST a JSON body (or raw bytes) to the HTTP port: the status and the decoded answer."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=120)
    try:
        connection.request("POST", route, data, {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def cosines(vectors: np.ndarray) -> np.ndarray:
    """The cosine of each row after the first with the first."""
    unit = np.asarray(vectors, dtype=np.float64)
    unit = unit / np.linalg.norm(unit, axis=1, keepdims=True)
    return unit[1:] @ unit[0]


def reference_tokenizer(folder: Path) -> Tokenizer:
    """A model folder's tokenizer.json as the `tokenizers` library reads it, without its padding."""
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_padding()
    return tokenizer


def test_similarity_is_the_cosine_of_the_embeddings(server: RunningServer, default_folder: Path) -> None:
    status, similarities = post(server, "/similarity", SIMILAR)
    assert status == 200 and len(similarities) == len(SENTENCES)
    status, embedded = post(server, "/embed", {"inputs": [SOURCE, *SENTENCES]})
    assert status == 200
    np.testing.assert_allclose(similarities, cosines(np.array(embedded)), atol=1e-6)
    model = SentenceTransformer(str(default_folder), device="cpu")
    encoded = model.encode([SOURCE, *SENTENCES], convert_to_numpy=True)
    np.testing.assert_allclose(similarities, model.similarity(encoded[:1], encoded[1:])[0].numpy(), atol=1e-4)
    assert int(np.argmax(similarities)) == 0  # the bread sentence is the nearest, as the model says
    named = {**SIMILAR, "model": DEFAULT_MODEL, "parameters": {"truncate": True, "truncation_direction": "Right"}}
    status, again = post(server, "/similarity", named)
    assert status == 200
    np.testing.assert_allclose(again, similarities, atol=1e-6)
    status, alone = post(server, "/similarity", {**SIMILAR, "parameters": None})
    assert status == 200
    np.testing.assert_allclose(alone, similarities, atol=1e-6)


def test_similarity_is_one_inference_in_the_envelope(server: RunningServer) -> None:
    answered = {"model": DEFAULT_MODEL, "version": "1", "code": "OK"}
    served = {"route": "/similarity", "status": "200"}
    before = metric_samples(server)
    assert post(server, "/similarity", SIMILAR)[0] == 200
    after = metric_samples(server)
    assert metric_value(after, "encoder_requests_total", **answered) == (
        metric_value(before, "encoder_requests_total", **answered) + 1
    )
    assert metric_value(after, "encoder_http_requests_total", **served) == (
        metric_value(before, "encoder_http_requests_total", **served) + 1
    )
    wait_for_metric(server, "encoder_answer_bytes_in_flight", 0)  # released once sent


def test_similarity_parameters_reach_the_engine(server: RunningServer) -> None:
    long_sentence = "food " * 400
    body = {"inputs": {"source_sentence": SOURCE, "sentences": [SENTENCES[0], long_sentence]}}
    status, whole = post(server, "/similarity", {**body, "parameters": {"truncate": False}})
    assert status == 200 and len(whole) == 2  # the long sentence embedded whole, in windows
    status, similarities = post(server, "/similarity", body)
    assert status == 200 and len(similarities) == 2  # cut at the maximum by default
    assert whole[0] == pytest.approx(similarities[0], abs=1e-6) and whole[1] != pytest.approx(similarities[1])


@pytest.mark.parametrize("special", [True, False])
def test_decode_gives_the_tokenizer_text(server: RunningServer, repository: Path, special: bool) -> None:
    tokenizer = reference_tokenizer(repository / DEFAULT_MODEL)
    ids = [encoding.ids for encoding in tokenizer.encode_batch([SOURCE, *SENTENCES])]
    status, texts = post(server, "/decode", {"ids": ids, "skip_special_tokens": special})
    assert status == 200
    assert texts == tokenizer.decode_batch(ids, skip_special_tokens=special)
    assert texts[0] == ("a man is eating food." if special else "[CLS] a man is eating food. [SEP]")
    status, single = post(server, "/decode", {"ids": ids[1], "skip_special_tokens": special})
    assert status == 200 and single == texts[1:2]
    assert post(server, "/decode", {"ids": []}) == (200, [""])  # as TEI: one empty sequence


def test_decode_round_trips_tokenize(server: RunningServer, repository: Path) -> None:
    status, tokens = post(server, "/tokenize", {"inputs": [SOURCE, *SENTENCES]})
    assert status == 200
    ids = [[token["id"] for token in row] for row in tokens]
    status, texts = post(server, "/decode", {"ids": ids})
    assert status == 200
    assert texts == reference_tokenizer(repository / DEFAULT_MODEL).decode_batch(ids)
    assert texts[:3] == [text.lower() for text in (SOURCE, *SENTENCES[:2])]  # an uncased model: lower case back


def test_decode_uses_the_named_model_tokenizer(server: RunningServer, repository: Path) -> None:
    tokenizer = reference_tokenizer(repository / CLASSIFIER)
    ids = tokenizer.encode(task_models.SENTENCES[0]).ids
    status, texts = post(server, "/decode", {"ids": [ids], "model": CLASSIFIER})
    assert status == 200 and texts == [tokenizer.decode(ids)]
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    status, answer = post(server, "/decode", {"ids": [ids[0], size], "model": CLASSIFIER})
    assert status == 422 and answer["error_type"] == "Validation"
    assert f"sequence 0, position 1: token id {size} is not in the tokenizer's vocabulary" in answer["error"]
    assert post(server, "/decode", {"ids": [ids[0], size]})[0] == 200  # within the default model's vocabulary


@pytest.mark.parametrize(
    ("route", "body", "status", "message"),
    [
        ("/similarity", {"inputs": {"source_sentence": SOURCE, "sentences": []}}, 422, "inputs.sentences is empty"),
        ("/similarity", {"inputs": {"source_sentence": SOURCE}}, 422, "inputs.sentences is required"),
        ("/similarity", {"inputs": {"source_sentence": SOURCE, "sentences": SOURCE}}, 422, "a list of strings"),
        ("/similarity", {"inputs": {"source_sentence": SOURCE, "sentences": [SOURCE, 3]}}, 422, "a list of strings"),
        ("/similarity", {"inputs": {"sentences": SENTENCES}}, 422, "inputs.source_sentence is required"),
        ("/similarity", {"inputs": {"source_sentence": 1, "sentences": SENTENCES}}, 422, "source_sentence is required"),
        ("/similarity", {"inputs": [SOURCE, *SENTENCES]}, 422, "inputs must be a JSON object"),
        ("/similarity", {"parameters": {}}, 422, "inputs is required"),
        ("/similarity", {"inputs": {**SIMILAR["inputs"], "top_k": 1}}, 422, "unknown field 'top_k' in inputs"),
        ("/similarity", {**SIMILAR, "parameters": {"normalize": True}}, 422, "unknown field 'normalize' in parameters"),
        ("/similarity", {**SIMILAR, "parameters": [True]}, 422, "parameters must be a JSON object"),
        ("/similarity", {**SIMILAR, "truncate": True}, 422, 'truncate goes in parameters: {"parameters"'),
        ("/similarity", {**SIMILAR, "normalize": True}, 422, "unknown field 'normalize' (accepted: inputs"),
        ("/similarity", {**SIMILAR, "parameters": {"truncate": "no"}}, 422, "truncate must be true or false"),
        ("/similarity", {**SIMILAR, "parameters": {"truncation_direction": "Left"}}, 422, "must be Right"),
        ("/similarity", {**SIMILAR, "parameters": {"prompt_name": "query"}}, 422, "prompts: none"),
        ("/similarity", {**SIMILAR, "model": CLASSIFIER}, 422, f"model {CLASSIFIER} is a classify model"),
        ("/similarity", {**SIMILAR, "model": "elsewhere"}, 404, "elsewhere"),
        ("/similarity", {"inputs": {"source_sentence": SOURCE, "sentences": [" "]}}, 422, "input text[1] is empty"),
        ("/similarity", b'{"inputs": ', 422, "not valid JSON"),
        ("/similarity", [SIMILAR], 422, "the request body must be a JSON object"),
        ("/decode", {"skip_special_tokens": True}, 422, "ids is required"),
        ("/decode", {"ids": "101 102"}, 422, "ids must be a list of token ids, or a list of such lists"),
        ("/decode", {"ids": [101, "x"]}, 422, 'ids[1] must be a token id (an integer), got "x"'),
        ("/decode", {"ids": [101, True]}, 422, "ids[1] must be a token id (an integer), got true"),
        ("/decode", {"ids": [[101], [102, 1.5]]}, 422, "ids[1][1] must be a token id (an integer), got 1.5"),
        ("/decode", {"ids": [[101], 102]}, 422, "ids[0] must be a token id (an integer), got [101]"),
        (
            "/decode",
            {"ids": [101, 30522]},
            422,
            "sequence 0, position 1: token id 30522 is not in the tokenizer's vocabulary (30522 tokens, ids 0 to"
            " 30521)",
        ),
        ("/decode", {"ids": [[101], [-1]]}, 422, "sequence 1, position 0: token id -1 is not in"),
        ("/decode", {"ids": [2**70]}, 422, f"token id {2**70} is not in"),
        ("/decode", {"ids": [101], "skip_special_tokens": "no"}, 422, "skip_special_tokens must be true or false"),
        ("/decode", {"ids": [101], "model": TOKEN_IDS_ONLY}, 422, "takes token ids, not text: it has no tokenizer"),
        ("/decode", {"ids": [101], "model": "elsewhere"}, 404, "elsewhere"),
        ("/decode", {"ids": [101], "inputs": "x"}, 422, "unknown field 'inputs' (accepted: ids"),
    ],
)
def test_malformed_bodies_get_tei_errors(
    server: RunningServer, route: str, body: object, status: int, message: str
) -> None:
    got, answer = post(server, route, body)
    assert got == status and message in answer["error"], answer
    assert answer["error_type"] == "Validation"
    assert post(server, "/similarity", SIMILAR)[0] == 200  # still serving
    assert post(server, "/decode", {"ids": [101, 102]}) == (200, [""])


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/similarity", {"inputs": {"source_sentence": SOURCE, "sentences": ["x"] * MAX_INPUTS}}),
        ("/decode", {"ids": [[101]] * (MAX_INPUTS + 1)}),
    ],
)
def test_too_many_rows_are_refused_413(server: RunningServer, route: str, body: object) -> None:
    status, answer = post(server, route, body)
    assert status == 413 and answer["error_type"] == "Validation"
    # The source sentence is a row of the inference: 2,048 sentences are 2,049 rows.
    expected = f"{MAX_INPUTS + 1} inputs, over the limit of {MAX_INPUTS} per request (--max-embedding-inputs)"
    assert expected in answer["error"], answer
    assert post(server, "/similarity", SIMILAR)[0] == 200  # still serving


def test_embed_all_gives_each_tokens_vector_as_sentence_transformers(
    server: RunningServer, default_folder: Path
) -> None:
    texts = [SOURCE, *SENTENCES, "word " * 300]
    status, answer = post(server, "/embed_all", {"inputs": texts})
    assert status == 200
    expected = SentenceTransformer(str(default_folder), device="cpu").encode(texts, output_value="token_embeddings")
    assert [len(rows) for rows in answer] == [len(rows) for rows in expected]  # unpadded; the long one cut at 256
    for served, tokens in zip(answer, expected, strict=True):
        np.testing.assert_allclose(np.array(served), tokens.numpy(), rtol=0, atol=1e-4)
    status, refused = post(server, "/embed_all", {"inputs": texts[-1:], "truncate": False})
    assert status == 422 and "last_hidden_state cannot be answered" in refused["error"]
    status, refused = post(server, "/embed_all", {"inputs": [SOURCE], "normalize": True})
    assert status == 422 and "unknown field 'normalize'" in refused["error"]
