"""Multi-vector embeddings and late-interaction scoring served: ColBERT and bge-m3 through real clients.

A PyLate-made ColBERT model's vectors (as queries and as documents) and MaxSim scores are compared
with PyLate's own answers on the same folder (tests.multivector_models), over gRPC (tritonclient),
KServe REST, TEI's /embed_all and /rerank, and Cohere's /v1/rerank; a tiny bge-m3's three outputs
from the same server with FlagEmbedding's on its folder. Bad requests get precise refusals.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from client import EmbeddingClient
from export.gate.references.bge_m3 import bge_m3_flag_model
from tests.multivector_models import BGE_M3_TEXTS, BGE_M3_WIDTH, QUERY_LENGTH, WIDTH, ExportedBgeM3, ExportedColbert
from tests.servers import RunningServer, start_server
from tests.servers import post_json as post

MODEL = "colbert"
BGE_M3 = "bge-m3"
MAX_RESPONSE_BYTES = 200_000
"""Room for a dozen texts' vectors as JSON, not for 64 long ones."""


@pytest.fixture(scope="module")
def server(
    colbert: ExportedColbert, bge_m3: ExportedBgeM3, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    """The ColBERT model and bge-m3 in one repository, with a response limit a large multi-vector answer misses."""
    repository = tmp_path_factory.mktemp("multivector-repository")
    shutil.copytree(colbert.published, repository / MODEL)
    shutil.copytree(bge_m3.published, repository / BGE_M3)
    log = repository.parent / "server.log"
    with start_server(repository, log, "--max-response-bytes", str(MAX_RESPONSE_BYTES)) as running:
        yield running


def _text(name: str, texts: list[str]) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([text.encode() for text in texts], dtype=object))
    return tensor


def grpc_vectors(server: RunningServer, texts: list[str], input_type: str) -> list[np.ndarray]:
    """Each text's vectors from the outputs multivector and multivector_lengths."""
    with grpcclient.InferenceServerClient(server.target) as client:
        result = client.infer(
            MODEL,
            [_text("text", texts)],
            outputs=[grpcclient.InferRequestedOutput(name) for name in ("multivector", "multivector_lengths")],
            parameters={"input_type": input_type},
        )
    vectors, lengths = result.as_numpy("multivector"), result.as_numpy("multivector_lengths")[:, 0]
    assert vectors.shape == (len(texts), lengths.max(), WIDTH)
    assert not vectors[lengths.argmin(), lengths.min() :].any()  # zeros after a row's own vectors
    return [vectors[row, :length] for row, length in enumerate(lengths)]


def test_vectors_over_grpc_equal_pylates(server: RunningServer, colbert: ExportedColbert) -> None:
    for input_type in ("query", "document"):
        for index, ours in enumerate(grpc_vectors(server, colbert.texts, input_type)):
            theirs = colbert.pylate[f"{input_type}{index}"]
            assert ours.shape == theirs.shape, (input_type, index)
            np.testing.assert_allclose(ours, theirs, atol=1e-4)
    assert all(len(vectors) == QUERY_LENGTH for vectors in grpc_vectors(server, colbert.texts[:3], "query"))


def test_scores_of_pairs_over_grpc_equal_pylates(server: RunningServer, colbert: ExportedColbert) -> None:
    queries, documents = colbert.texts[:2], colbert.texts[:5]
    with grpcclient.InferenceServerClient(server.target) as client:
        metadata = client.get_model_metadata(MODEL)
        declared = {output.name: (output.datatype, list(output.shape)) for output in metadata.outputs}
        assert declared == {
            "multivector": ("FP32", [-1, -1, WIDTH]),
            "multivector_lengths": ("INT64", [-1, 1]),
            "score": ("FP32", [-1, 1]),
        }
        assert [tensor.name for tensor in metadata.inputs][:2] == ["text", "query"]
        pairs = [(query, document) for query in queries for document in documents]
        result = client.infer(MODEL, [_text("query", [q for q, _ in pairs]), _text("text", [d for _, d in pairs])])
    expected = colbert.pylate["scores"][: len(queries), : len(documents)].ravel()
    np.testing.assert_allclose(result.as_numpy("score")[:, 0], expected, atol=1e-4)


def test_embed_all_and_rerank_routes(server: RunningServer, colbert: ExportedColbert) -> None:
    status, vectors = post(server, "/embed_all", {"inputs": colbert.texts[:3], "input_type": "query", "model": MODEL})
    assert status == 200
    for index, ours in enumerate(vectors):
        np.testing.assert_allclose(np.array(ours), colbert.pylate[f"query{index}"], atol=1e-4)
    query, documents = colbert.texts[0], colbert.texts[1:6]
    expected = colbert.pylate["scores"][0, 1:6]
    status, ranked = post(server, "/rerank", {"query": query, "texts": documents, "model": MODEL})
    assert status == 200 and [item["index"] for item in ranked] == list(np.argsort(-expected, kind="stable"))
    np.testing.assert_allclose([item["score"] for item in ranked], np.sort(expected)[::-1], atol=1e-4)
    status, cohere = post(server, "/v1/rerank", {"query": query, "documents": documents, "top_n": 2, "model": MODEL})
    assert status == 200 and [item["index"] for item in cohere["results"]] == [item["index"] for item in ranked[:2]]


def test_kserve_rest_gives_the_same_vectors(server: RunningServer, colbert: ExportedColbert) -> None:
    body = {
        "inputs": [{"name": "text", "datatype": "BYTES", "shape": [2], "data": colbert.texts[:2]}],
        "parameters": {"input_type": "document"},
    }
    status, answer = post(server, f"/v2/models/{MODEL}/infer", body)
    assert status == 200
    outputs = {output["name"]: output for output in answer["outputs"]}
    lengths = outputs["multivector_lengths"]["data"]
    vectors = np.array(outputs["multivector"]["data"], dtype=np.float32).reshape(outputs["multivector"]["shape"])
    for row in range(2):
        np.testing.assert_allclose(vectors[row, : lengths[row]], colbert.pylate[f"document{row}"], atol=1e-4)


@pytest.mark.parametrize(
    ("parameters", "outputs", "message"),
    [
        ({"input_type": "passage"}, ["multivector"], "input_type must be query or document, got 'passage'"),
        ({}, ["score"], "output score scores (query, text) pairs: send the queries in input query"),
        ({"truncate": False}, ["multivector"], "truncate false is not supported for multi-vector texts"),
        ({}, ["embedding"], "unknown output 'embedding' (outputs: multivector, multivector_lengths, score, token_ids,"),
        ({"top_k": 3}, ["multivector"], "parameter top_k: model colbert answers no sparse embedding"),
    ],
)
def test_bad_requests_are_refused_precisely(
    server: RunningServer, colbert: ExportedColbert, parameters: dict, outputs: list[str], message: str
) -> None:
    with grpcclient.InferenceServerClient(server.target) as client:
        with pytest.raises(InferenceServerException, match=re.escape(message)) as refused:
            client.infer(
                MODEL,
                [_text("text", colbert.texts[:1])],
                outputs=[grpcclient.InferRequestedOutput(name) for name in outputs],
                parameters=parameters,
            )
        assert "StatusCode.INVALID_ARGUMENT" in str(refused.value.status())
        assert client.is_server_ready()


def test_a_multivector_answer_over_the_response_limit_is_refused(
    server: RunningServer, colbert: ExportedColbert
) -> None:
    many = [colbert.texts[-1]] * 64
    status, answer = post(server, "/embed_all", {"inputs": many, "model": MODEL})
    assert status == 413 and "--max-response-bytes" in answer["error"]
    status, vectors = post(server, "/embed_all", {"inputs": colbert.texts[:2], "model": MODEL})
    assert status == 200 and len(vectors) == 2
    status, answer = post(server, "/v1/embeddings", {"model": MODEL, "input": ["bread"]})
    assert status == 400 and "unknown output 'embedding'" in answer["error"]["message"]


def test_bge_m3s_three_outputs_from_one_request_equal_flag_embeddings(
    server: RunningServer, bge_m3: ExportedBgeM3
) -> None:
    texts = BGE_M3_TEXTS[:6]
    names = ("embedding", "sparse_indices", "sparse_values", "multivector", "multivector_lengths")
    with grpcclient.InferenceServerClient(server.target) as client:
        result = client.infer(
            BGE_M3, [_text("text", texts)], outputs=[grpcclient.InferRequestedOutput(name) for name in names]
        )
    flag_model = bge_m3_flag_model()(str(bge_m3.source), use_fp16=False, devices="cpu", colbert_dim=BGE_M3_WIDTH)
    expected = flag_model.encode(texts, max_length=256, return_dense=True, return_sparse=True, return_colbert_vecs=True)
    np.testing.assert_allclose(result.as_numpy("embedding"), expected["dense_vecs"], atol=1e-4)
    indices, values = result.as_numpy("sparse_indices"), result.as_numpy("sparse_values")
    lengths = result.as_numpy("multivector_lengths")[:, 0]
    for row, weights in enumerate(expected["lexical_weights"]):
        served = {int(i): float(v) for i, v in zip(indices[row], values[row], strict=True) if i >= 0}
        theirs = {int(i): float(v) for i, v in weights.items() if float(v) > 1e-4}
        assert set(theirs) <= set(served) and all(abs(served[i] - theirs.get(i, 0.0)) <= 1e-4 for i in served)
        vectors = result.as_numpy("multivector")[row, : lengths[row]]
        np.testing.assert_allclose(vectors, expected["colbert_vecs"][row], atol=1e-4)


def test_bge_m3_reranks_by_maxsim_mean_and_answers_terms_on_embed_sparse(
    server: RunningServer, bge_m3: ExportedBgeM3
) -> None:
    query, documents = BGE_M3_TEXTS[0], BGE_M3_TEXTS[1:5]
    flag_model = bge_m3_flag_model()(str(bge_m3.source), use_fp16=False, devices="cpu", colbert_dim=BGE_M3_WIDTH)
    encoded = flag_model.encode([query, *documents], max_length=256, return_sparse=True, return_colbert_vecs=True)
    expected = np.array(
        [float(flag_model.colbert_score(encoded["colbert_vecs"][0], v)) for v in encoded["colbert_vecs"][1:]]
    )
    # Scores far enough apart that a document given another's score is caught.
    assert np.diff(np.sort(expected)).min() > 1e-3
    status, ranked = post(server, "/rerank", {"query": query, "texts": documents, "model": BGE_M3})
    assert status == 200 and sorted(item["index"] for item in ranked) == list(range(len(documents)))
    order = [item["index"] for item in ranked]
    np.testing.assert_allclose([item["score"] for item in ranked], expected[order], atol=1e-4)
    assert order == list(np.argsort(-expected, kind="stable"))
    with EmbeddingClient(server.target, model=BGE_M3) as client:
        ranking = client.rerank(query, documents)
    np.testing.assert_array_equal(ranking.indices, order)
    np.testing.assert_allclose(ranking.scores, expected[order], atol=1e-4)

    # The two documents with the most terms (a random tiny model leaves a short text few), top_k below their counts.
    lexical = encoded["lexical_weights"][1:]
    chosen = sorted(range(len(documents)), key=lambda i: -len(lexical[i]))[:2]
    top_k = min(3, *(len(lexical[i]) for i in chosen))
    assert top_k >= 2, [len(weights) for weights in lexical]
    inputs = [documents[i] for i in chosen]
    status, terms = post(server, "/embed_sparse", {"inputs": inputs, "model": BGE_M3, "top_k": top_k})
    assert status == 200 and len(terms) == 2
    for row, i in zip(terms, chosen, strict=True):
        theirs = {int(index): float(value) for index, value in lexical[i].items()}
        largest = sorted(theirs.values(), reverse=True)[:top_k]
        assert len(row) == top_k
        # Each token id served carries FlagEmbedding's weight for it, and those are its largest, largest first.
        np.testing.assert_allclose([term["value"] for term in row], largest, atol=1e-4)
        np.testing.assert_allclose([theirs.get(term["index"], 0.0) for term in row], largest, atol=1e-4)
