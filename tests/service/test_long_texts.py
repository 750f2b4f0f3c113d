"""Texts longer than the model (truncate false): embedded in windows and combined, against the same done by hand.

The reference splits each text with the reference library's own tokenizer (transformers, overflowing
tokens with the same stride), runs each window through SentenceTransformer, and combines the windows'
vectors by their tokens, normalising again. The server must give the same vector through every
protocol, and refuse precisely what its limits refuse.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
import tritonclient.grpc as grpcclient
from sentence_transformers import SentenceTransformer
from tritonclient.utils import InferenceServerException

from tests.conftest import DEFAULT_MODEL
from tests.servers import RunningServer, start_server
from tests.servers import post_json as post
from tests.vectors import assert_same_vectors, row_cosines

LONG = [
    "The weather turned cold over the mountains. " * 40,
    "Markets fell sharply after the announcement, and traders sold their shares. " * 25,
]
TEXTS = ["A short sentence.", *LONG]
OVERLAP = 32
MAX_CHUNKS = 6


def by_hand(folder: Path, texts: list[str], overlap: int) -> np.ndarray:
    """Each text in windows of 256 tokens sharing `overlap`, through SentenceTransformer, token-weighted, normalised."""
    model = SentenceTransformer(str(folder), device="cpu")
    vectors = []
    for text in texts:
        windows = model.tokenizer(
            text, truncation=True, max_length=256, stride=overlap, return_overflowing_tokens=True, padding=True
        )
        features = {
            "input_ids": torch.tensor(windows["input_ids"]),
            "attention_mask": torch.tensor(windows["attention_mask"]),
            "token_type_ids": torch.tensor(windows["token_type_ids"]),
        }
        with torch.inference_mode():
            embedded = model(features)["sentence_embedding"].numpy()
        weights = features["attention_mask"].sum(dim=1).numpy()[:, None].astype(np.float64)
        vector = (embedded * weights).sum(axis=0) / weights.sum()
        vectors.append(vector / np.linalg.norm(vector))
    return np.array(vectors, dtype=np.float32)


def grpc_embed(server: RunningServer, texts: list[str], **parameters: object) -> np.ndarray:
    with grpcclient.InferenceServerClient(server.target) as client:
        tensor = grpcclient.InferInput("text", [len(texts)], "BYTES")
        tensor.set_data_from_numpy(np.array([text.encode() for text in texts], dtype=object))
        outputs = [grpcclient.InferRequestedOutput("embedding")]
        return client.infer(DEFAULT_MODEL, [tensor], outputs=outputs, parameters=parameters).as_numpy("embedding")


@pytest.fixture(scope="module")
def overlapping(default_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """The default model with windows sharing 32 tokens, and at most 6 windows a request."""
    log = tmp_path_factory.mktemp("long-texts") / "server.log"
    flags = ("--chunk-overlap-tokens", str(OVERLAP), "--max-chunks-per-request", str(MAX_CHUNKS))
    with start_server(default_repository, log, *flags) as running:
        yield running


def test_windows_combined_as_by_hand_over_grpc(default_server: RunningServer, default_folder: Path) -> None:
    served = grpc_embed(default_server, TEXTS, truncate=False)
    assert_same_vectors(served, by_hand(default_folder, TEXTS, overlap=0), min_cosine=0.9999)
    truncated = grpc_embed(default_server, TEXTS)
    np.testing.assert_allclose(served[0], truncated[0], atol=1e-6)  # a short text is one window: unchanged


def test_every_protocol_gives_the_same_whole_text_vector(default_server: RunningServer) -> None:
    expected = grpc_embed(default_server, LONG, truncate=False)
    status, tei = post(default_server, "/embed", {"inputs": LONG, "truncate": False})
    assert status == 200
    status, cohere = post(default_server, "/v2/embed", {"model": DEFAULT_MODEL, "texts": LONG, "truncate": "NONE"})
    assert status == 200
    client = openai.OpenAI(base_url=default_server.http_url + "/v1", api_key="unused")
    # OpenAI's API has no truncate field: the extension travels in extra_body, as prompt_name does.
    answer = client.embeddings.create(model=DEFAULT_MODEL, input=LONG, extra_body={"truncate": False})
    np.testing.assert_allclose(np.array([item.embedding for item in answer.data]), expected, atol=1e-6)
    for answer in (tei, cohere["embeddings"]["float"]):
        np.testing.assert_allclose(np.array(answer), expected, atol=1e-6)


def test_compact_forms_come_from_the_combined_vector(default_server: RunningServer) -> None:
    status, answer = post(
        default_server,
        "/v2/embed",
        {"model": DEFAULT_MODEL, "texts": LONG, "truncate": "NONE", "embedding_types": ["float", "ubinary"]},
    )
    assert status == 200
    floats = np.array(answer["embeddings"]["float"], dtype=np.float32)
    np.testing.assert_array_equal(np.array(answer["embeddings"]["ubinary"]), np.packbits(floats > 0, axis=1))


def test_overlapping_windows_as_by_hand(overlapping: RunningServer, default_folder: Path) -> None:
    served = grpc_embed(overlapping, LONG[:1], truncate=False)
    assert_same_vectors(served, by_hand(default_folder, LONG[:1], overlap=OVERLAP), min_cosine=0.9999)
    without_overlap = by_hand(default_folder, LONG[:1], overlap=0)
    assert 0.99 < row_cosines(served, without_overlap)[0] < 0.9999  # near, not equal: the overlap counts twice


def test_windows_over_the_limit_and_token_outputs_are_refused(overlapping: RunningServer) -> None:
    with pytest.raises(InferenceServerException, match=r"make \d+ windows of up to 256 tokens, over the limit of 6"):
        grpc_embed(overlapping, LONG * 3, truncate=False)
    with grpcclient.InferenceServerClient(overlapping.target) as client:
        tensor = grpcclient.InferInput("text", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([LONG[0].encode()], dtype=object))
        with pytest.raises(InferenceServerException, match="output last_hidden_state cannot be answered for texts"):
            client.infer(DEFAULT_MODEL, [tensor], parameters={"truncate": False})
        assert client.is_server_ready()
    status, answer = post(overlapping, "/embed", {"inputs": LONG * 3, "truncate": False})
    assert status == 413 and "--max-chunks-per-request" in answer["error"]


CHUNKS = [
    "The river rose through the night.",
    "By morning it had reached the bridge, and the village was cut off.",
    "Boats brought bread from the other bank.",
]


def late_chunked_by_hand(folder: Path, chunks: list[str]) -> np.ndarray:
    """Late chunking by hand with transformers' model: one [CLS] chunks [SEP] sequence, a mean per chunk, normalised.

    Each chunk is tokenised alone, its tokens laid end to end with the others'.
    """
    model = SentenceTransformer(str(folder), device="cpu")
    tokenizer, encoder = model.tokenizer, model[0].auto_model
    pieces = [tokenizer(chunk, add_special_tokens=False)["input_ids"] for chunk in chunks]
    ids = [tokenizer.cls_token_id, *(token for piece in pieces for token in piece), tokenizer.sep_token_id]
    with torch.inference_mode():
        states = encoder(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    states = states.last_hidden_state[0].numpy()
    vectors, start = [], 1
    for piece in pieces:
        vector = states[start : start + len(piece)].mean(axis=0)
        vectors.append(vector / np.linalg.norm(vector))
        start += len(piece)
    return np.array(vectors, dtype=np.float32)


def test_late_chunking_as_by_hand_over_grpc_and_openai(default_server: RunningServer, default_folder: Path) -> None:
    expected = late_chunked_by_hand(default_folder, CHUNKS)
    served = grpc_embed(default_server, CHUNKS, late_chunking=True)
    assert_same_vectors(served, expected, min_cosine=0.9999)
    alone = grpc_embed(default_server, CHUNKS)
    assert (row_cosines(served, alone) < 0.9999).all()  # each chunk saw the whole document
    client = openai.OpenAI(base_url=default_server.http_url + "/v1", api_key="unused")
    answer = client.embeddings.create(model=DEFAULT_MODEL, input=CHUNKS, extra_body={"late_chunking": True})
    np.testing.assert_allclose(np.array([item.embedding for item in answer.data]), served, atol=1e-6)
    assert answer.usage.prompt_tokens == sum(len(p) for p in _pieces(default_folder, CHUNKS)) + 2


def _pieces(folder: Path, chunks: list[str]) -> list[list[int]]:
    tokenizer = SentenceTransformer(str(folder), device="cpu").tokenizer
    return [tokenizer(chunk, add_special_tokens=False)["input_ids"] for chunk in chunks]


def test_late_chunking_refusals(default_server: RunningServer) -> None:
    with pytest.raises(InferenceServerException, match=r"late chunking: the 2 chunks make a document of \d+ tokens"):
        grpc_embed(default_server, LONG, late_chunking=True)
    with grpcclient.InferenceServerClient(default_server.target) as client:
        tensor = grpcclient.InferInput("text", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([CHUNKS[0].encode()], dtype=object))
        with pytest.raises(InferenceServerException, match="output last_hidden_state cannot be answered with"):
            client.infer(
                DEFAULT_MODEL,
                [tensor],
                outputs=[grpcclient.InferRequestedOutput("last_hidden_state")],
                parameters={"late_chunking": True},
            )
        assert client.is_server_ready()
    status, answer = post(
        default_server, "/v1/embeddings", {"model": DEFAULT_MODEL, "input": CHUNKS, "late_chunking": "yes"}
    )
    assert status == 400 and "late_chunking must be true or false" in answer["error"]["message"]


def test_each_windows_own_vector_on_request(default_server: RunningServer, default_folder: Path) -> None:
    with grpcclient.InferenceServerClient(default_server.target) as client:
        tensor = grpcclient.InferInput("text", [len(TEXTS)], "BYTES")
        tensor.set_data_from_numpy(np.array([text.encode() for text in TEXTS], dtype=object))
        names = ("embedding", "chunk_embeddings", "chunk_counts")
        result = client.infer(
            DEFAULT_MODEL,
            [tensor],
            outputs=[grpcclient.InferRequestedOutput(name) for name in names],
            parameters={"truncate": False},
        )
    counts = result.as_numpy("chunk_counts")[:, 0]
    chunks = result.as_numpy("chunk_embeddings")
    assert counts[0] == 1 and (counts[1:] > 1).all() and len(chunks) == counts.sum()
    model = SentenceTransformer(str(default_folder), device="cpu")
    windows = model.tokenizer(LONG[0], truncation=True, max_length=256, return_overflowing_tokens=True)
    texts = model.tokenizer.batch_decode(windows["input_ids"], skip_special_tokens=True)
    first = slice(int(counts[0]), int(counts[0] + counts[1]))
    # Each window alone through the reference: the window's own vector (decoded text re-tokenises the same here).
    assert_same_vectors(chunks[first], model.encode(texts, convert_to_numpy=True), min_cosine=0.9999)
    np.testing.assert_allclose(chunks[0], result.as_numpy("embedding")[0], atol=1e-6)
