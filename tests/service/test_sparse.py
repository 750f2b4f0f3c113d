"""Sparse (SPLADE) embeddings served: the terms over gRPC (tritonclient) and TEI's /embed_sparse, against SparseEncoder.

A tiny SPLADE model (tests.export.tiny_models.save_sparse_encoder: MLMTransformer + SpladePooling,
random weights, a real WordPiece tokenizer) is exported by the real command line and served. Its
terms must be sentence-transformers' `SparseEncoder.encode` of the same texts: the same indices,
values within 1e-4, largest first.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from sentence_transformers import SparseEncoder
from tritonclient.utils import InferenceServerException

from client import EmbeddingClient
from service.pipeline.sparse import terms
from tests.export import tiny_models
from tests.export_cache import cached_export
from tests.servers import RunningServer, start_server
from tests.servers import post_json as post

MODEL = "splade"
TEXTS = tiny_models.training_sentences()[:6]


def _export(folder: Path) -> None:
    """The tiny SPLADE folder as SparseEncoder saves it (folder/source/model), exported by `python -m export --source`
    into folder/repository."""
    source = tiny_models.save_sparse_encoder(folder / "source")
    command = [sys.executable, "-m", "export", "--source", str(source), "--repository", str(folder / "repository")]
    done = subprocess.run([*command, "--name", MODEL, "--threads", "1"], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def exported() -> Path:
    """The folder _export filled, shared across pytest runs (tests.export_cache)."""
    return cached_export("served-splade", [MODEL], _export, made_by=(Path(tiny_models.__file__),))


@pytest.fixture(scope="module")
def source(exported: Path) -> Path:
    """The tiny SPLADE folder, as SparseEncoder saved it."""
    return exported / "source" / "model"


@pytest.fixture(scope="module")
def server(exported: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """The folder exported by `python -m export --source` and served."""
    with start_server(exported / "repository", tmp_path_factory.mktemp("splade-server") / "server.log") as running:
        yield running


@pytest.fixture(scope="module")
def expected(source: Path) -> np.ndarray:
    """SparseEncoder.encode of the texts, densified [texts, vocab]."""
    encoded = SparseEncoder(str(source), device="cpu").encode(TEXTS, convert_to_tensor=True)
    return encoded.to_dense().numpy()


def grpc_terms(server: RunningServer, texts: list[str], **parameters: object) -> grpcclient.InferResult:
    with grpcclient.InferenceServerClient(server.target) as client:
        tensor = grpcclient.InferInput("text", [len(texts)], "BYTES")
        tensor.set_data_from_numpy(np.array([text.encode() for text in texts], dtype=object))
        outputs = [grpcclient.InferRequestedOutput(name) for name in ("sparse_indices", "sparse_values")]
        return client.infer(MODEL, [tensor], outputs=outputs, parameters=parameters or None)


def densified(indices: np.ndarray, values: np.ndarray, vocab: int) -> np.ndarray:
    dense = np.zeros((len(indices), vocab), dtype=np.float32)
    for row, (row_indices, row_values) in enumerate(zip(indices, values, strict=True)):
        kept = row_indices >= 0
        dense[row, row_indices[kept]] = row_values[kept]
    return dense


def assert_largest_terms(indices: np.ndarray, values: np.ndarray, expected: np.ndarray, top_k: int) -> None:
    """Each row's terms are SparseEncoder's top_k largest: each token id with its weight there, largest first."""
    for row, dense in enumerate(expected):
        largest = np.sort(dense)[::-1][:top_k]
        assert (indices[row] >= 0).all()
        assert (largest > 0).all()  # the text has that many terms: none is padding
        np.testing.assert_allclose(values[row], largest, rtol=0, atol=1e-4)
        np.testing.assert_allclose(dense[indices[row]], largest, rtol=0, atol=1e-4)


def test_terms_order_and_padding() -> None:
    dense = np.array([[0, 0.5, 0, 2.0, 0.5], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]], dtype=np.float32)
    indices, values = terms(dense, None)
    np.testing.assert_array_equal(indices, [[3, 1, 4], [-1, -1, -1], [0, -1, -1]])
    np.testing.assert_array_equal(values, [[2.0, 0.5, 0.5], [0, 0, 0], [1.0, 0, 0]])
    indices, values = terms(dense, 1)
    np.testing.assert_array_equal(indices, [[3], [-1], [0]])


def test_grpc_terms_equal_sparse_encoder(server: RunningServer, expected: np.ndarray) -> None:
    result = grpc_terms(server, TEXTS)
    assert result.get_output("sparse_indices").datatype == "INT64"
    indices, values = result.as_numpy("sparse_indices"), result.as_numpy("sparse_values")
    served = densified(indices, values, expected.shape[1])
    np.testing.assert_array_equal(served != 0, expected != 0)
    np.testing.assert_allclose(served, expected, rtol=0, atol=1e-4)
    for row_indices, row_values in zip(indices, values, strict=True):
        assert (np.diff(row_values[row_indices >= 0]) <= 0).all()  # largest first


def test_top_k_keeps_the_largest_terms(server: RunningServer, expected: np.ndarray) -> None:
    result = grpc_terms(server, TEXTS, top_k=3)
    indices, values = result.as_numpy("sparse_indices"), result.as_numpy("sparse_values")
    assert indices.shape == (len(TEXTS), 3)
    assert_largest_terms(indices, values, expected, 3)
    with pytest.raises(InferenceServerException, match="top_k must be a positive integer"):
        grpc_terms(server, TEXTS[:1], top_k=0)


def test_sdk_embed_sparse_equals_sparse_encoder(server: RunningServer, expected: np.ndarray) -> None:
    # Batches of 4 and 2 texts: the SDK pads the narrower batch's terms to the wider one's.
    with EmbeddingClient(server.target, model=MODEL, batch_size=4) as client:
        every, top = client.embed_sparse(TEXTS), client.embed_sparse(TEXTS, top_k=3)
    np.testing.assert_allclose(densified(every.indices, every.values, expected.shape[1]), expected, rtol=0, atol=1e-4)
    np.testing.assert_array_equal(every.counts, np.count_nonzero(expected, axis=1))
    first = every.row(0)
    assert sorted(first) == np.flatnonzero(expected[0]).tolist()
    np.testing.assert_allclose([first[i] for i in sorted(first)], expected[0][sorted(first)], rtol=0, atol=1e-4)
    assert top.indices.shape == (len(TEXTS), 3)
    assert_largest_terms(top.indices, top.values, expected, 3)


def test_tei_embed_sparse(server: RunningServer, expected: np.ndarray) -> None:
    status, answer = post(server, "/embed_sparse", {"inputs": TEXTS})
    assert status == 200
    for row, text_terms in enumerate(answer):
        dense = np.zeros(expected.shape[1], dtype=np.float32)
        for term in text_terms:
            dense[term["index"]] = term["value"]
        np.testing.assert_allclose(dense, expected[row], rtol=0, atol=1e-4)
        assert len(text_terms) == np.count_nonzero(expected[row])
    status, answer = post(server, "/embed_sparse", {"inputs": TEXTS[:2], "top_k": 2})
    assert status == 200 and [len(text_terms) for text_terms in answer] == [2, 2]
    indices = np.array([[term["index"] for term in text_terms] for text_terms in answer])
    values = np.array([[term["value"] for term in text_terms] for text_terms in answer])
    assert_largest_terms(indices, values, expected[:2], 2)
    status, answer = post(server, "/embed_sparse", {"inputs": TEXTS[0], "normalize": True})
    assert status == 422 and "unknown field 'normalize'" in answer["error"]
    status, answer = post(server, "/embed", {"inputs": TEXTS[0]})
    assert status == 404 and "no embed model" in answer["error"]


def test_metadata_declares_the_terms(server: RunningServer) -> None:
    with grpcclient.InferenceServerClient(server.target) as client:
        metadata = client.get_model_metadata(MODEL, as_json=True)
    outputs = {output["name"]: (output["datatype"], output["shape"]) for output in metadata["outputs"]}
    assert outputs["sparse_indices"] == ("INT64", ["-1", "-1"])
    assert outputs["sparse_values"] == ("FP32", ["-1", "-1"])
