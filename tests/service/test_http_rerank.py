"""Rerank and classify routes over raw HTTP: TEI's /rerank and /predict, Cohere/Jina's /v1/rerank, on a real server.

The repository holds the default embedder (with a prompt declared) beside two hand-built classifiers
that use its tokenizer: a reranker (one label) and a three-label classifier. Their logits are a
plain function of the token ids, mask and segment ids, so the expected answers come from running
the same ONNX graphs here on the `tokenizers` library's own pair encodings (no torch).
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import openai
import pytest
from tokenizers import Tokenizer

from protocol import model_config_pb2 as mc
from service.core.repository import config_text, parse_config
from service.pipeline.tokenizer import TextTokenizer
from tests.conftest import DEFAULT_MODEL
from tests.servers import RunningServer, metric_samples, metric_value, start_server
from tests.task_models import classifier_graph

EMBEDDER = "embedder"
RERANKER = "reranker"
CLASSIFIER = "sentiment"
LABELS = ("negative", "neutral", "positive")
LABEL_WEIGHTS = {RERANKER: ([1.0], [0.0]), CLASSIFIER: ([1.0, -1.0, 0.5], [0.0, 1.0, 0.0])}
"""logits = s * weights + biases, s = mean of id * (1 + segment) / 1000 - 5 (tests.task_models.classifier_graph)."""
QUERY = "How do I bake bread?"
TEXTS = ["Knead the dough and let it rise.", "Stocks fell today.", "Bread needs flour, water and yeast.", "Zebra."]


def write_model(source: Path, folder: Path, labels: tuple[str, ...] | None, prompts: dict[str, str]) -> None:
    """A model folder with the default model's tokenizer: its own fp32 graph (labels: a classifier) or a link."""
    config = parse_config((source / "config.pbtxt").read_text(), source)
    (folder / "1").mkdir(parents=True)
    (folder / "tokenizer.json").symlink_to(source / "tokenizer.json")
    for key in [key for key in config.parameters if key.startswith(("variant.", "preferred_variant."))]:
        del config.parameters[key]
    config.default_model_filename = "model.onnx"
    config.name = folder.name
    if labels is None:
        (folder / "1" / "model.onnx").symlink_to(source / "1" / "model.onnx")
        (folder / "embedding_ranges.npz").symlink_to(source / "embedding_ranges.npz")
        config.parameters["prompts"].string_value = json.dumps(prompts)
    else:
        weights, biases = LABEL_WEIGHTS[folder.name]
        classifier_graph(folder / "1" / "model.onnx", weights, biases, segments=True, scale=1000, offset=5)
        del config.output[:]
        config.output.add(name="logits", data_type=mc.TYPE_FP32, dims=[len(labels)])
        for key in ("pooling", "normalize", "embedding_ranges", "embedding_calibration"):
            del config.parameters[key]
        config.parameters["task"].string_value = "classify"
        config.parameters["labels"].string_value = json.dumps(list(labels))
    (folder / "config.pbtxt").write_text(config_text(config))


@pytest.fixture(scope="module")
def repository(default_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default embedder (prompt `query`), a one-label reranker and a three-label classifier side by side."""
    root = tmp_path_factory.mktemp("rerank-repository")
    source = default_repository / DEFAULT_MODEL
    write_model(source, root / EMBEDDER, None, {"query": "query: "})
    write_model(source, root / RERANKER, ("LABEL_0",), {})
    write_model(source, root / CLASSIFIER, LABELS, {})
    return root


@pytest.fixture(scope="module")
def server(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """One server for the whole repository."""
    with start_server(repository, tmp_path_factory.mktemp("rerank-server") / "server.log") as running:
        yield running


def post(server: RunningServer, route: str, body: object, key: str | None = None) -> tuple[int, object]:
    """POST a JSON body (or raw bytes) to the HTTP port, with an API key if given: the status and the decoded answer."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    try:
        connection.request("POST", route, data, headers)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def get(server: RunningServer, route: str) -> object:
    """GET a route of the HTTP port that must answer 200: its decoded answer."""
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    try:
        connection.request("GET", route)
        response = connection.getresponse()
        assert response.status == 200
        return json.loads(response.read())
    finally:
        connection.close()


def reference_tokenizer(repository: Path, model: str) -> Tokenizer:
    """The model's tokenizer as the tokenizers library reads it: truncated at the maximum, not padded."""
    tokenizer = Tokenizer.from_file(str(repository / model / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(256)
    return tokenizer


def expected_logits(repository: Path, model: str, pairs: list[tuple[str, ...]]) -> np.ndarray:
    """The model's logits for texts or (query, text) pairs, run here on the tokenizers library's encodings."""
    tokenizer = reference_tokenizer(repository, model)
    session = ort.InferenceSession(str(repository / model / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    rows = []
    for pair in pairs:
        encoding = tokenizer.encode(*pair)
        feed = {
            "input_ids": np.array([encoding.ids], dtype=np.int64),
            "attention_mask": np.array([encoding.attention_mask], dtype=np.int64),
            "token_type_ids": np.array([encoding.type_ids], dtype=np.int64),
        }
        rows.append(session.run(["logits"], feed)[0][0])
    return np.array(rows, dtype=np.float64)


def sigmoid(values: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-values))


def test_rerank_sorts_by_the_graph_logit_of_each_pair(server: RunningServer, repository: Path) -> None:
    logits = expected_logits(repository, RERANKER, [(QUERY, text) for text in TEXTS])[:, 0]
    order = list(np.argsort(-logits, kind="stable"))
    status, ranked = post(server, "/rerank", {"query": QUERY, "texts": TEXTS, "return_text": True})
    assert status == 200
    assert [item["index"] for item in ranked] == order
    assert [item["score"] for item in ranked] == pytest.approx(list(sigmoid(logits[order])), abs=1e-5)
    assert [item["text"] for item in ranked] == [TEXTS[i] for i in order]
    status, raw = post(server, "/rerank", {"query": QUERY, "texts": TEXTS, "raw_scores": True, "model": RERANKER})
    assert status == 200 and "text" not in raw[0]
    assert [item["score"] for item in raw] == pytest.approx(list(logits[order]), abs=1e-4)


def test_cohere_rerank_keeps_top_n_with_documents(server: RunningServer, repository: Path) -> None:
    logits = expected_logits(repository, RERANKER, [(QUERY, text) for text in TEXTS])[:, 0]
    order = list(np.argsort(-logits, kind="stable"))
    documents = [TEXTS[0], {"text": TEXTS[1]}, *TEXTS[2:]]
    body = {"model": RERANKER, "query": QUERY, "documents": documents, "top_n": 2, "return_documents": True}
    status, answer = post(server, "/v1/rerank", body)
    assert status == 200 and answer["model"] == RERANKER
    assert [result["index"] for result in answer["results"]] == order[:2]
    assert [result["relevance_score"] for result in answer["results"]] == pytest.approx(
        list(sigmoid(logits[order[:2]])), abs=1e-5
    )
    assert [result["document"]["text"] for result in answer["results"]] == [TEXTS[i] for i in order[:2]]
    tokenizer = reference_tokenizer(repository, RERANKER)
    assert answer["usage"]["total_tokens"] == sum(len(tokenizer.encode(QUERY, text).ids) for text in TEXTS)
    status, plain = post(server, "/v1/rerank", {"query": QUERY, "documents": TEXTS})  # the one reranker
    assert status == 200 and len(plain["results"]) == len(TEXTS) and "document" not in plain["results"][0]


def test_predict_labels_texts_pairs_and_batches(server: RunningServer, repository: Path) -> None:
    single = expected_logits(repository, CLASSIFIER, [(TEXTS[0],)])[0]
    probabilities = np.exp(single - single.max()) / np.exp(single - single.max()).sum()
    status, answer = post(server, "/predict", {"inputs": TEXTS[0], "model": CLASSIFIER})
    assert status == 200
    assert [item["label"] for item in answer] == [LABELS[i] for i in np.argsort(-probabilities, kind="stable")]
    assert {item["label"]: item["score"] for item in answer} == pytest.approx(
        dict(zip(LABELS, probabilities, strict=True))
    )
    pair = expected_logits(repository, CLASSIFIER, [(QUERY, TEXTS[1])])[0]
    status, answer = post(server, "/predict", {"inputs": [QUERY, TEXTS[1]], "model": CLASSIFIER, "raw_scores": True})
    assert status == 200
    assert {item["label"]: item["score"] for item in answer} == pytest.approx(
        dict(zip(LABELS, pair, strict=True)), abs=1e-4
    )
    batch = expected_logits(repository, RERANKER, [(TEXTS[2],), (TEXTS[3],)])[:, 0]
    status, answer = post(server, "/predict", {"inputs": [[TEXTS[2]], [TEXTS[3]]], "model": RERANKER})
    assert status == 200
    assert [row[0]["score"] for row in answer] == pytest.approx(list(sigmoid(batch)), abs=1e-5)
    assert [row[0]["label"] for row in answer] == ["LABEL_0", "LABEL_0"]


def test_nameless_routes_go_to_the_one_model_of_their_task(server: RunningServer) -> None:
    status, embedded = post(server, "/embed", {"inputs": TEXTS[:2]})
    client = openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0)
    expected = [item.embedding for item in client.embeddings.create(model=EMBEDDER, input=TEXTS[:2]).data]
    assert status == 200
    np.testing.assert_allclose(embedded, expected, atol=1e-6)
    status, refusal = post(server, "/predict", {"inputs": TEXTS[0]})
    assert status == 422 and refusal["error_type"] == "Validation"
    assert "several classify models are served (reranker, sentiment)" in refusal["error"]
    info = get(server, "/info")
    assert info["model_id"] == EMBEDDER and info["model_type"] == {"embedding": {"pooling": "mean"}}
    assert {model["id"]: model["task"] for model in info["models"]} == {
        EMBEDDER: "embed",
        RERANKER: "classify",
        CLASSIFIER: "classify",
    }


def test_openai_sdk_sends_prompt_name_in_extra_body(server: RunningServer) -> None:
    client = openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0)
    prompted = client.embeddings.create(model=EMBEDDER, input=TEXTS[:2], extra_body={"prompt_name": "query"}).data
    by_hand = client.embeddings.create(model=EMBEDDER, input=["query: " + text for text in TEXTS[:2]]).data
    np.testing.assert_allclose([item.embedding for item in prompted], [item.embedding for item in by_hand], atol=1e-6)
    status, embedded = post(server, "/embed", {"inputs": TEXTS[:2], "prompt_name": "query"})
    assert status == 200
    np.testing.assert_allclose(embedded, [item.embedding for item in by_hand], atol=1e-6)
    with pytest.raises(openai.BadRequestError, match="prompts: query"):
        client.embeddings.create(model=EMBEDDER, input=TEXTS[:1], extra_body={"prompt_name": "passage"})


def test_tokenize_takes_a_classifier_tokenizer_when_named(server: RunningServer, repository: Path) -> None:
    status, tokens = post(server, "/tokenize", {"inputs": [QUERY], "model": RERANKER})
    assert status == 200
    assert [token["id"] for token in tokens[0]] == reference_tokenizer(repository, RERANKER).encode(QUERY).ids
    status, answer = post(server, "/tokenize", {"inputs": [QUERY], "model": RERANKER, "prompt_name": "query"})
    assert status == 422 and "is a classify model and has no prompts" in answer["error"]  # as inference says it


def test_truncate_false_refuses_a_pair_that_would_be_cut(server: RunningServer, repository: Path) -> None:
    long_text = "bread " * 400
    status, answer = post(server, "/rerank", {"query": QUERY, "texts": [long_text], "truncate": False})
    assert status == 422 and answer["error_type"] == "Validation" and "pair 0 has" in answer["error"]
    status, answer = post(server, "/rerank", {"query": QUERY, "texts": [long_text]})
    assert status == 200 and len(answer) == 1  # truncated by default
    tokenizer = TextTokenizer(repository / RERANKER / "tokenizer.json", 256)
    assert tokenizer.count_tokens((QUERY, long_text)) > 256


@pytest.mark.parametrize(
    ("route", "body", "status", "message"),
    [
        ("/rerank", {"query": QUERY, "texts": TEXTS, "model": CLASSIFIER}, 422, "not a reranker"),
        ("/rerank", {"query": QUERY, "texts": TEXTS, "model": EMBEDDER}, 422, "is a embed model"),
        ("/rerank", {"query": QUERY, "texts": []}, 422, "texts must be a string or a non-empty list"),
        ("/rerank", {"texts": TEXTS}, 422, "query is required"),
        ("/rerank", {"query": QUERY, "texts": TEXTS, "raw_scores": "yes"}, 422, "raw_scores must be true or false"),
        ("/rerank", {"query": QUERY, "texts": TEXTS, "truncation_direction": "Left"}, 422, "must be Right"),
        ("/rerank", [QUERY], 422, "must be a JSON object"),
        ("/predict", {"inputs": [["a", "b", "c"]], "model": CLASSIFIER}, 422, "inputs[0] must be [text]"),
        ("/predict", {"inputs": 3, "model": CLASSIFIER}, 422, "inputs must be a string, a pair"),
        ("/predict", {"model": CLASSIFIER}, 422, "inputs is required"),
        ("/predict", {"inputs": "x", "model": "nowhere"}, 404, "nowhere"),
        ("/v1/rerank", {"query": QUERY, "documents": []}, 400, "documents is required"),
        ("/v1/rerank", {"query": QUERY, "documents": ["x"], "top_n": "2"}, 400, "top_n must be a positive"),
        ("/v1/rerank", {"query": QUERY, "documents": ["x"], "return_documents": 1}, 400, "return_documents must be"),
        ("/v1/rerank", {"query": QUERY, "documents": ["x"], "model": CLASSIFIER}, 400, "not a reranker"),
        ("/v1/rerank", {"query": QUERY, "documents": ["x"], "stream": True}, 400, "unrecognized request argument"),
        ("/v1/rerank", b"[1,", 400, "not valid JSON"),
    ],
)
def test_malformed_bodies_get_a_precise_refusal(
    server: RunningServer, route: str, body: object, status: int, message: str
) -> None:
    got, answer = post(server, route, body)
    if route == "/v1/rerank":  # Cohere's error body: {"message"} alone
        assert got == status and list(answer) == ["message"] and message in answer["message"], answer
    else:
        assert got == status and message in answer["error"] and answer["error_type"] == "Validation", answer
    assert post(server, "/rerank", {"query": QUERY, "texts": TEXTS[:1]})[0] == 200  # still serving


def test_routes_are_counted_by_template(server: RunningServer) -> None:
    before = metric_value(metric_samples(server), "encoder_http_requests_total", route="/predict", status="200")
    assert post(server, "/predict", {"inputs": TEXTS[0], "model": CLASSIFIER})[0] == 200
    after = metric_value(metric_samples(server), "encoder_http_requests_total", route="/predict", status="200")
    assert after == before + 1


def test_api_keys_guard_the_task_routes(repository: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("rerank-test-key-7a1e\n")
    (tmp_path / "repository").mkdir()
    (tmp_path / "repository" / RERANKER).symlink_to(repository / RERANKER)  # the reranker alone: a quick start
    body = {"query": QUERY, "texts": TEXTS[:2], "model": RERANKER}
    with start_server(tmp_path / "repository", tmp_path / "server.log", "--api-key-file", str(keys)) as keyed:
        status, answer = post(keyed, "/rerank", body)
        assert status == 401 and answer["error_type"] == "Unauthorized" and "API key" in answer["error"]
        status, answer = post(keyed, "/v1/rerank", {"query": QUERY, "documents": TEXTS[:2]}, key="wrong")
        assert status == 401 and "API key" in answer["message"]
        assert post(keyed, "/rerank", body, key="rerank-test-key-7a1e")[0] == 200
        assert post(keyed, "/v1/rerank", {"query": QUERY, "documents": TEXTS[:2]}, key="rerank-test-key-7a1e")[0] == 200


def test_too_many_documents_are_refused_413(server: RunningServer) -> None:
    documents = ["x"] * 2049  # one over --max-embedding-inputs' default
    status, answer = post(server, "/rerank", {"query": QUERY, "texts": documents})
    assert status == 413 and answer["error_type"] == "Validation" and "--max-embedding-inputs" in answer["error"]
    status, answer = post(server, "/v1/rerank", {"query": QUERY, "documents": documents})
    assert status == 413 and "--max-embedding-inputs" in answer["message"]
