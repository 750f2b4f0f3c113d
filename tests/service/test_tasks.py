"""Embedders, rerankers and classifiers of every family, exported and served side by side, checked against the source.

One repository (tests/conftest.py `exported_tasks`) holds an embedder of every architecture (XLM-R
with prompts and Matryoshka widths, ModernBERT with a default prompt, every pooling mode), two
rerankers (BERT, XLM-R: segment ids and `</s></s>` pairs) and a three-label DistilBERT
classifier, each exported by the real exporter from a tiny random model with a real tokenizer.
Answers are compared with SentenceTransformer.encode and CrossEncoder.predict on the source
folders, through clients we did not write (tritonclient, the openai SDK) and raw HTTP.
"""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
import transformers
import tritonclient.grpc as grpcclient
from sentence_transformers import CrossEncoder, SentenceTransformer
from tritonclient.utils import InferenceServerException

from service.core.fidelity import cosines
from tests.conftest import ExportedTasks
from tests.export import tiny_models
from tests.servers import RunningServer, start_server
from tests.servers import post_json as post
from tests.vectors import assert_same_vectors

TEXTS = [*tiny_models.training_sentences()[:6], "A longer document about the weather, " * 5]
QUERY = tiny_models.training_sentences()[7]
EMBEDDERS = tuple(name for name, source in tiny_models.TASK_SOURCES.items() if source.task == "embed")
RERANKERS = ("bert-reranker", "xlmr-reranker")
CLASSIFIER = "distilbert-classifier"
LABELS = tiny_models.LABELS


@pytest.fixture(scope="module")
def sources(exported_tasks: ExportedTasks) -> dict[str, Path]:
    """The source folders: sentence-transformers embedders, sequence-classification checkpoints."""
    return exported_tasks.sources


@pytest.fixture(scope="module")
def repository(exported_tasks: ExportedTasks) -> Path:
    """Every source exported (fp32) into one repository (tests/conftest.py)."""
    return exported_tasks.repository


@pytest.fixture(scope="module")
def server(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """One server for the whole repository."""
    with start_server(repository, tmp_path_factory.mktemp("task-server") / "server.log") as running:
        yield running


@pytest.fixture(scope="module")
def pod_repository(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An embedder and a reranker side by side, as one pod serves them: the nameless routes need no model field."""
    root = tmp_path_factory.mktemp("pod-repository")
    for name in ("xlmr-embed", "bert-reranker"):
        shutil.copytree(repository / name, root / name)
    return root


@pytest.fixture(scope="module")
def pod(pod_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with start_server(pod_repository, tmp_path_factory.mktemp("pod-server") / "server.log") as running:
        yield running


def cross_encoder_logits(folder: Path, pairs: list[tuple[str, str]]) -> np.ndarray:
    """CrossEncoder.predict's raw logits, [pairs, labels]."""
    predicted = CrossEncoder(str(folder), device="cpu").predict(pairs, activation_fn=torch.nn.Identity())
    return np.asarray(predicted, dtype=np.float64).reshape(len(pairs), -1)


def classifier_logits(folder: Path, text: str) -> torch.Tensor:
    """transformers' logits for one single text (CrossEncoder takes pairs only)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(folder)).eval()
    with torch.inference_mode():
        return model(**tokenizer([text], return_tensors="pt")).logits


def bytes_input(name: str, texts: list[str]) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([text.encode() for text in texts], dtype=object))
    return tensor


@pytest.mark.parametrize("name", EMBEDDERS)
def test_served_embeddings_equal_sentence_transformers(server: RunningServer, sources: dict, name: str) -> None:
    client = openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused")
    model = SentenceTransformer(str(sources[name]), device="cpu")
    served = np.array([item.embedding for item in client.embeddings.create(model=name, input=TEXTS).data])
    # The direction and the values: distilbert-embed's vectors are not normalised, so a cosine alone would pass
    # a served vector of the wrong length.
    assert_same_vectors(served, model.encode(TEXTS), min_cosine=0.9999)
    if name == "xlmr-embed":
        prompted = client.embeddings.create(model=name, input=TEXTS, extra_body={"prompt_name": "query"}).data
        expected = model.encode(TEXTS, prompt_name="query")
        assert_same_vectors(np.array([item.embedding for item in prompted]), expected, min_cosine=0.9999)
        assert cosines(served, expected).min() < 0.9999  # the prompt did change the vectors


@pytest.mark.parametrize("name", RERANKERS)
def test_reranker_logits_over_grpc_equal_cross_encoder(server: RunningServer, sources: dict, name: str) -> None:
    client = grpcclient.InferenceServerClient(server.target)
    answer = client.infer(name, [bytes_input("query", [QUERY] * len(TEXTS)), bytes_input("text", TEXTS)])
    logits = answer.as_numpy("logits")
    expected = cross_encoder_logits(sources[name], [(QUERY, text) for text in TEXTS])
    assert logits.shape == (len(TEXTS), 1)
    np.testing.assert_allclose(logits, expected, atol=1e-4)
    assert list(np.argsort(-logits[:, 0])) == list(np.argsort(-expected[:, 0]))


def test_reranker_metadata_and_config_say_what_it_takes(server: RunningServer) -> None:
    client = grpcclient.InferenceServerClient(server.target)
    metadata = client.get_model_metadata("xlmr-reranker", as_json=True)
    assert [tensor["name"] for tensor in metadata["inputs"]][:2] == ["text", "query"]
    assert metadata["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": ["-1", "1"]}]
    parameters = client.get_model_config("xlmr-reranker", as_json=True)["config"]["parameters"]
    assert parameters["task"]["string_value"] == "classify"
    assert parameters["model_type"]["string_value"] == "xlm-roberta"
    with urllib.request.urlopen(server.http_url + "/v1/models/xlmr-embed", timeout=30) as answer:
        card = json.loads(answer.read())
    assert card["task"] == "embed" and card["prompts"]["query"] == "query: " and card["dimensions"] == [32, 16, 8]
    embedder = client.get_model_config("xlmr-embed", as_json=True)["config"]["parameters"]
    assert json.loads(embedder["prompts"]["string_value"])["query"] == "query: "
    assert json.loads(embedder["matryoshka_dimensions"]["string_value"]) == [16, 8]


def test_rerank_route_sorts_by_cross_encoder_score(server: RunningServer, sources: dict) -> None:
    body = {"query": QUERY, "texts": TEXTS, "model": "xlmr-reranker", "return_text": True}
    status, ranked = post(server, "/rerank", body)
    logits = cross_encoder_logits(sources["xlmr-reranker"], [(QUERY, text) for text in TEXTS])[:, 0]
    assert status == 200
    assert [item["index"] for item in ranked] == list(np.argsort(-logits, kind="stable"))
    for item in ranked:
        assert item["score"] == pytest.approx(1 / (1 + np.exp(-logits[item["index"]])), abs=1e-5)
        assert item["text"] == TEXTS[item["index"]]
    status, raw = post(server, "/rerank", {**body, "raw_scores": True, "return_text": False})
    assert status == 200 and "text" not in raw[0]
    assert [item["score"] for item in raw] == pytest.approx(sorted(logits, reverse=True), abs=1e-4)


def test_predict_gives_labels_with_softmax_scores(server: RunningServer, sources: dict) -> None:
    status, single = post(server, "/predict", {"inputs": TEXTS[0], "model": CLASSIFIER})
    assert status == 200
    probabilities = torch.softmax(classifier_logits(sources[CLASSIFIER], TEXTS[0]), dim=1)[0]
    assert {item["label"]: item["score"] for item in single} == pytest.approx(
        {LABELS[i]: float(p) for i, p in enumerate(probabilities)}, abs=1e-5
    )
    assert [item["score"] for item in single] == sorted((item["score"] for item in single), reverse=True)
    status, batch = post(
        server,
        "/predict",
        {"inputs": [[TEXTS[0], TEXTS[1]], [TEXTS[2], TEXTS[3]]], "model": CLASSIFIER, "raw_scores": True},
    )
    pairs = cross_encoder_logits(sources[CLASSIFIER], [(TEXTS[0], TEXTS[1]), (TEXTS[2], TEXTS[3])])
    assert status == 200 and len(batch) == 2
    for answers, expected in zip(batch, pairs, strict=True):
        assert {item["label"]: item["score"] for item in answers} == pytest.approx(
            {LABELS[i]: value for i, value in enumerate(expected)}, abs=1e-4
        )


def test_pod_routes_need_no_model_name(pod: RunningServer) -> None:
    status, embedded = post(pod, "/embed", {"inputs": TEXTS[:2]})
    client = openai.OpenAI(base_url=pod.http_url + "/v1", api_key="unused")
    expected = [item.embedding for item in client.embeddings.create(model="xlmr-embed", input=TEXTS[:2]).data]
    assert status == 200
    np.testing.assert_allclose(embedded, expected, atol=1e-6)
    status, ranked = post(
        pod,
        "/v1/rerank",
        {"query": QUERY, "documents": [TEXTS[0], {"text": TEXTS[1]}, TEXTS[2]], "top_n": 2, "return_documents": True},
    )
    assert status == 200 and ranked["model"] == "bert-reranker" and len(ranked["results"]) == 2
    scores = [result["relevance_score"] for result in ranked["results"]]
    assert scores == sorted(scores, reverse=True) and all(0 < score < 1 for score in scores)
    assert ranked["results"][0]["document"]["text"] in TEXTS[:3] and ranked["usage"]["total_tokens"] > 0
    status, rerank = post(pod, "/rerank", {"query": QUERY, "texts": [TEXTS[0], TEXTS[1], TEXTS[2]]})
    assert status == 200
    assert [item["index"] for item in rerank][:2] == [result["index"] for result in ranked["results"]]
    with urllib.request.urlopen(pod.http_url + "/info", timeout=30) as answer:
        info = json.loads(answer.read())
    assert info["model_id"] == "xlmr-embed" and info["model_type"] == {"embedding": {"pooling": "mean"}}
    assert {model["id"]: model["task"] for model in info["models"]} == {
        "xlmr-embed": "embed",
        "bert-reranker": "classify",
    }


def test_tokenize_gives_the_model_tokenizer_ids(pod: RunningServer, sources: dict) -> None:
    status, tokens = post(pod, "/tokenize", {"inputs": [TEXTS[0]], "prompt_name": "passage"})
    tokenizer = SentenceTransformer(str(sources["xlmr-embed"]), device="cpu").tokenizer
    assert status == 200
    assert [token["id"] for token in tokens[0]] == tokenizer("passage: " + TEXTS[0])["input_ids"]
    assert tokens[0][0]["special"] and tokens[0][0]["start"] is None
    words = [token for token in tokens[0] if not token["special"]]
    assert all(("passage: " + TEXTS[0])[t["start"] : t["stop"]] == t["text"] for t in words)


def test_matryoshka_dimensions_shorten_and_renormalise(server: RunningServer) -> None:
    client = openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused")
    full = np.array(client.embeddings.create(model="xlmr-embed", input=TEXTS[:3]).data[0].embedding)
    short = np.array(client.embeddings.create(model="xlmr-embed", input=TEXTS[:3], dimensions=8).data[0].embedding)
    np.testing.assert_allclose(short, full[:8] / np.linalg.norm(full[:8]), atol=1e-6)
    with pytest.raises(openai.BadRequestError, match="can give 32, 16, 8 dimensions, not 5"):
        client.embeddings.create(model="xlmr-embed", input=TEXTS[:1], dimensions=5)
    with pytest.raises(openai.BadRequestError, match="not trained to be shortened"):
        client.embeddings.create(model="mpnet-embed", input=TEXTS[:1], dimensions=8)


def test_truncate_false_refuses_a_long_pair_and_embeds_a_long_text(server: RunningServer) -> None:
    long_text = "weather " * 400
    client = grpcclient.InferenceServerClient(server.target)
    with pytest.raises(InferenceServerException, match=r"pair 0 has \d+ tokens"):
        client.infer(
            "bert-reranker",
            [bytes_input("query", [QUERY]), bytes_input("text", [long_text])],
            parameters={"truncate": False},
        )
    outputs = [grpcclient.InferRequestedOutput("embedding")]
    whole = client.infer(
        "xlmr-embed", [bytes_input("text", [long_text])], outputs=outputs, parameters={"truncate": False}
    )
    assert whole.as_numpy("embedding").shape == (1, 32)
    status, answer = post(server, "/embed", {"inputs": long_text, "truncate": False, "model": "xlmr-embed"})
    assert status == 200
    np.testing.assert_allclose(answer, whole.as_numpy("embedding"), atol=1e-6)


@pytest.mark.parametrize(
    ("route", "body", "status", "message"),
    [
        ("/embed", {"inputs": TEXTS[0]}, 422, "several embed models are served (bert-embed, distilbert-embed"),
        (
            "/embed",
            {"inputs": TEXTS[0], "model": "bert-reranker"},
            422,
            "is a classify model; this route needs a embed",
        ),
        ("/embed", {"inputs": [], "model": "xlmr-embed"}, 422, "inputs must be a string or a non-empty list"),
        (
            "/embed",
            {"inputs": "x", "model": "xlmr-embed", "prompt_name": "nope"},
            422,
            "prompts: document, passage, query",
        ),
        ("/embed", {"inputs": "x", "model": "xlmr-embed", "normalize": False}, 422, "normalize false is not available"),
        ("/embed", b"{not json", 422, "not valid JSON"),
        ("/embed", {"inputs": "x", "model": "nowhere"}, 404, "nowhere"),
        (
            "/rerank",
            {"query": QUERY, "texts": TEXTS},
            422,
            "several rerankers (classify models of one label, or multi-vector models) are served",
        ),
        ("/rerank", {"query": "", "texts": TEXTS, "model": "bert-reranker"}, 422, "query is required"),
        ("/rerank", {"query": QUERY, "texts": "x", "model": CLASSIFIER}, 422, "not a reranker"),
        (
            "/rerank",
            {"query": QUERY, "texts": ["x"], "model": "bert-reranker", "extra": 1},
            422,
            "unknown field 'extra'",
        ),
        ("/predict", {"inputs": ["a", "b", "c"], "model": CLASSIFIER}, 422, "a list of strings is one pair"),
        ("/predict", {"inputs": [["a"], ["a", "b"]], "model": CLASSIFIER}, 422, "all single texts or all pairs"),
        ("/tokenize", {"inputs": 3, "model": "xlmr-embed"}, 422, "inputs must be a string"),
        ("/v1/rerank", {"query": QUERY, "documents": [1], "model": "bert-reranker"}, 400, "documents[0] must be"),
        ("/v1/rerank", {"query": QUERY, "documents": ["x"], "model": "bert-reranker", "top_n": 0}, 400, "top_n"),
        ("/v1/embeddings", {"model": "xlmr-embed", "input": "x", "prompt_name": 3}, 400, "prompt_name must be"),
    ],
)
def test_malformed_task_requests_get_a_precise_refusal(
    server: RunningServer, route: str, body: object, status: int, message: str
) -> None:
    got, answer = post(server, route, body)
    text = json.dumps(answer)
    assert got == status and message in text.replace('\\"', '"'), answer
    assert post(server, "/rerank", {"query": QUERY, "texts": TEXTS[:2], "model": "bert-reranker"})[0] == 200


def test_grpc_refuses_pairs_it_cannot_pair(server: RunningServer) -> None:
    client = grpcclient.InferenceServerClient(server.target)
    with pytest.raises(InferenceServerException, match="input query holds 1 elements and text 2"):
        client.infer("bert-reranker", [bytes_input("query", [QUERY]), bytes_input("text", TEXTS[:2])])
    with pytest.raises(InferenceServerException, match="unknown input 'query'"):
        client.infer("xlmr-embed", [bytes_input("query", [QUERY]), bytes_input("text", [QUERY])])
    with pytest.raises(InferenceServerException, match="has no prompts"):
        client.infer("bert-reranker", [bytes_input("text", [QUERY])], parameters={"prompt_name": "query"})


def test_pairs_survive_several_front_ends(pod_repository: Path, sources: dict, tmp_path: Path) -> None:
    pairs = [(QUERY, text) for text in TEXTS]
    expected = cross_encoder_logits(sources["bert-reranker"], pairs)
    with start_server(pod_repository, tmp_path / "server.log", "--frontends", "2") as running:
        client = grpcclient.InferenceServerClient(running.target)
        for _ in range(4):  # connections land on either front end
            answer = client.infer(
                "bert-reranker", [bytes_input("query", [QUERY] * len(TEXTS)), bytes_input("text", TEXTS)]
            )
            np.testing.assert_allclose(answer.as_numpy("logits"), expected, atol=1e-4)
            client = grpcclient.InferenceServerClient(running.target)
