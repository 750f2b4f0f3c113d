"""Images on the task routes of a two-tower model, over raw HTTP against a real server on loopback: Cohere's
/v2/embed (`images`, and `inputs` with text and image_url parts) answers as the library that made the folder;
/similarity, /rerank and /v1/rerank with an image query or image documents score the cosine of the library's
vectors, best first; each bad item is refused naming its place. The repository holds three of
tests.export.two_tower_folders' shared exports and the default (text-only) model.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from export.gate.image_cases import image_cases
from service.core.fidelity import FIDELITY_MIN_COSINE, cosines
from service.core.repository import read_model
from service.pipeline.images import ImagePreprocessor
from tests.conftest import DEFAULT_MODEL
from tests.export.two_tower_folders import exported_two_towers, library_embeddings
from tests.servers import RunningServer, post_json, start_server

SERVED_MAX_ABS_DIFF = 1e-4
MODELS = ("clip", "siglip", "st-clip")
"""A CLIP folder (transformers), a SigLIP folder and a sentence-transformers CLIP folder."""
TEXTS = ["a photo of a cat", "Two dogs play in the snow near a red barn, while a third one sleeps.", "x"]


@pytest.fixture(scope="module")
def exported() -> Path:
    """source/<name> and the repository they were exported into."""
    return exported_two_towers()


@pytest.fixture(scope="module")
def server(
    exported: Path, default_repository: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    """The two-tower models and the default text-only model in one repository (links to the shared folders)."""
    repository = tmp_path_factory.mktemp("scores-repository")
    for name in MODELS:
        (repository / name).symlink_to(exported / "repository" / name)
    (repository / DEFAULT_MODEL).symlink_to(default_repository / DEFAULT_MODEL)
    with start_server(repository, repository.parent / "server.log") as running:
        yield running


def _images(exported: Path, name: str) -> list[bytes]:
    """The gate's images at the model's size: other sizes, portrait, landscape, grey, RGBA, a transparent PNG."""
    size = ImagePreprocessor.from_folder(exported / "repository" / name).output_size
    return [case.data for case in image_cases(size.height)]


def _data_uri(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def _library(exported: Path, name: str, images: list[bytes], texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The library's vectors of the images and of the texts, as the model is served."""
    padding = read_model(exported / "repository" / name).text_padding
    image_vectors, text_vectors = library_embeddings(exported / "source" / name, images, texts, padding)
    return image_vectors.numpy(), text_vectors.numpy()


def _assert_as_the_library(served: np.ndarray, expected: np.ndarray) -> None:
    assert served.shape == expected.shape
    assert np.abs(served - expected).max() <= SERVED_MAX_ABS_DIFF
    assert cosines(served, expected).min() >= FIDELITY_MIN_COSINE


def _cosines_to(query: np.ndarray, documents: np.ndarray) -> np.ndarray:
    """The cosine of each document's vector with the query's, in float64."""
    query = query / np.linalg.norm(query)
    return (documents / np.linalg.norm(documents, axis=1, keepdims=True)) @ query


def _post(server: RunningServer, route: str, body: dict) -> tuple[int, dict | list]:
    status, answer = post_json(server, route, body)
    assert isinstance(answer, dict | list)
    return status, answer


@pytest.mark.parametrize("name", MODELS)
def test_cohere_images_answer_as_the_library(server: RunningServer, exported: Path, name: str) -> None:
    images = _images(exported, name)
    expected, _ = _library(exported, name, images, [])
    body = {"model": name, "images": [_data_uri(image) for image in images], "input_type": "image"}
    status, answer = _post(server, "/v2/embed", body)
    assert status == 200, answer
    _assert_as_the_library(np.array(answer["embeddings"]["float"], dtype=np.float32), expected)
    assert answer["meta"]["billed_units"]["images"] == len(images)
    assert "texts" not in answer


def test_cohere_inputs_mix_texts_and_images_in_their_order(server: RunningServer, exported: Path) -> None:
    """Cohere's v2 inputs, each one part: text, image_url as {"url": ...} and as the data: URI itself."""
    images = _images(exported, "clip")[:2]
    expected_images, expected_texts = _library(exported, "clip", images, TEXTS[:2])
    inputs = [
        {"content": [{"type": "image_url", "image_url": {"url": _data_uri(images[0])}}]},
        {"content": [{"type": "text", "text": TEXTS[0]}]},
        {"content": [{"type": "image_url", "image_url": _data_uri(images[1])}]},
        {"content": [{"type": "text", "text": TEXTS[1]}]},
    ]
    body = {"model": "clip", "inputs": inputs, "embedding_types": ["float", "ubinary"]}
    status, answer = _post(server, "/v2/embed", body)
    assert status == 200, answer
    served = np.array(answer["embeddings"]["float"], dtype=np.float32)
    expected = np.stack([expected_images[0], expected_texts[0], expected_images[1], expected_texts[1]])
    _assert_as_the_library(served, expected)
    np.testing.assert_array_equal(np.array(answer["embeddings"]["ubinary"]), np.packbits(served > 0, axis=-1))
    assert answer["meta"]["billed_units"]["images"] == 2


def _image_part(data: str) -> dict:
    return {"content": [{"type": "image_url", "image_url": {"url": data}}]}


NOT_AN_IMAGE = base64.b64encode(b"these bytes are not an image").decode()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"images": ["data:image/png;base64,{good}", "https://example.com/cat.png"]}, "images[1] is a URL"),
        (
            {"inputs": [{"content": [{"type": "text", "text": "a cat"}]}, _image_part("http://example.com/a.png")]},
            "inputs[1].content[0].image_url is a URL: this server does not fetch remote images",
        ),
        ({"images": ["data:image/png;base64,{good}", NOT_AN_IMAGE]}, "images[1] is not a PNG, JPEG, WebP or GIF"),
        (
            {"inputs": [_image_part("{good_uri}"), {"content": [{"type": "text", "text": ""}]}]},
            "inputs[1] is empty",
        ),
        (
            {
                "inputs": [
                    {"content": [{"type": "text", "text": "a"}]},
                    _image_part("data:image/png;base64," + NOT_AN_IMAGE),
                ]
            },
            "inputs[1] is not a PNG, JPEG, WebP or GIF image",
        ),
        ({"images": ["data:text/plain;base64,aGk="]}, "images[0]: data: URI of type 'text/plain', not an image"),
        (
            {"inputs": [{"content": [{"type": "text", "text": "a cat"}, {"type": "image_url", "image_url": "x"}]}]},
            "inputs[0]: content must hold one part, a text or an image_url (it holds 2",
        ),
        ({"inputs": [{"content": [{"type": "audio"}]}]}, 'inputs[0].content[0] must be {"type": "text"'),
        ({"texts": ["a cat"], "images": ["data:image/png;base64,{good}"]}, "send texts or images, not both"),
        (
            {
                "inputs": [{"content": [{"type": "text", "text": "a"}]}, _image_part("{good_uri}")],
                "input_type": "image",
            },
            "or image (images), got 'image'",
        ),
        ({"model": DEFAULT_MODEL, "images": ["data:image/png;base64,{good}"]}, "this model has no image tower"),
    ],
    ids=[
        "URL",
        "URL in inputs",
        "not an image",
        "empty text",
        "not an image in inputs",
        "not an image type",
        "fused content",
        "unknown part",
        "texts and images",
        "input_type image with texts",
        "text-only model",
    ],
)
def test_cohere_refuses_a_bad_item_by_its_place(
    server: RunningServer, exported: Path, body: dict, message: str
) -> None:
    """400 with Cohere's {"message"}, naming the item; the same model then answers good images."""
    good = base64.b64encode(_images(exported, "clip")[0]).decode()
    filled = _filled(body, good)
    status, answer = _post(server, "/v2/embed", {"model": "clip", **filled})
    assert status == 400
    assert message in answer["message"]
    status, _ = _post(server, "/v2/embed", {"model": "clip", "images": [_data_uri(_images(exported, "clip")[0])]})
    assert status == 200


def _filled(value: object, good: str) -> object:
    """`value` with {good} (base64) and {good_uri} (a data: URI) replaced by a good image."""
    if isinstance(value, str):
        return value.replace("{good_uri}", "data:image/png;base64,{good}").replace("{good}", good)
    if isinstance(value, list):
        return [_filled(item, good) for item in value]
    if isinstance(value, dict):
        return {key: _filled(item, good) for key, item in value.items()}
    return value


@pytest.mark.parametrize("name", ["clip", "siglip"])
@pytest.mark.parametrize("source", ["image", "text"])
def test_similarity_scores_images_as_the_librarys_cosines(
    server: RunningServer, exported: Path, name: str, source: str
) -> None:
    """TEI's /similarity with an image (or a text) source and texts and images among the sentences."""
    images = _images(exported, name)
    library_images, library_texts = _library(exported, name, images, TEXTS)
    sentences = [{"image": base64.b64encode(image).decode()} for image in images[1:4]] + TEXTS
    expected_sentences = np.concatenate([library_images[1:4], library_texts])
    if source == "image":
        source_item, expected_source = {"image": _data_uri(images[0])}, library_images[0]
    else:
        source_item, expected_source = TEXTS[0], library_texts[0]
    body = {"model": name, "inputs": {"source_sentence": source_item, "sentences": sentences}}
    status, served = _post(server, "/similarity", body)
    assert status == 200, served
    expected = _cosines_to(expected_source, expected_sentences)
    np.testing.assert_allclose(np.array(served), expected, atol=SERVED_MAX_ABS_DIFF)


def _ranked_as_expected(indices: list[int], scores: list[float], expected: np.ndarray) -> None:
    """The scores equal the expected cosines, best first."""
    np.testing.assert_allclose(scores, expected[indices], atol=SERVED_MAX_ABS_DIFF)
    assert scores == sorted(scores, reverse=True)
    assert sorted(indices) == list(range(len(expected)))


@pytest.mark.parametrize("name", ["clip", "st-clip"])
def test_cohere_rerank_scores_image_documents_by_cosine(server: RunningServer, exported: Path, name: str) -> None:
    """Jina's convention for an image document ({"image": ...}), a text query; top_n keeps the best."""
    images = _images(exported, name)[:4]
    library_images, library_texts = _library(exported, name, images, TEXTS[:2])
    documents = [{"image": _data_uri(image)} for image in images] + [{"text": TEXTS[1]}]
    expected = _cosines_to(library_texts[0], np.concatenate([library_images, library_texts[1:]]))
    body = {"model": name, "query": TEXTS[0], "documents": documents, "return_documents": True}
    status, answer = _post(server, "/v1/rerank", body)
    assert status == 200, answer
    results = answer["results"]
    _ranked_as_expected([r["index"] for r in results], [r["relevance_score"] for r in results], expected)
    for result in results:
        assert result["document"] == documents[result["index"]]
    status, top = _post(server, "/v1/rerank", {**body, "top_n": 2, "return_documents": False})
    assert status == 200, top
    assert [r["index"] for r in top["results"]] == [r["index"] for r in results[:2]]


def test_tei_rerank_scores_an_image_query_by_cosine(server: RunningServer, exported: Path) -> None:
    """TEI's /rerank with an image query and texts and images among the texts; return_text echoes each."""
    images = _images(exported, "siglip")
    library_images, library_texts = _library(exported, "siglip", images, TEXTS)
    texts = [*TEXTS, {"image": base64.b64encode(images[1]).decode()}]
    expected = _cosines_to(library_images[0], np.concatenate([library_texts, library_images[1:2]]))
    body = {"model": "siglip", "query": {"image": _data_uri(images[0])}, "texts": texts, "return_text": True}
    status, answer = _post(server, "/rerank", body)
    assert status == 200, answer
    _ranked_as_expected([r["index"] for r in answer], [r["score"] for r in answer], expected)
    for result in answer:
        text = texts[result["index"]]
        assert result == {"index": result["index"], "score": result["score"]} | (
            {"text": text} if isinstance(text, str) else {"image": text["image"]}
        )


def test_a_named_two_tower_model_reranks_texts_by_cosine(server: RunningServer, exported: Path) -> None:
    _, library_texts = _library(exported, "clip", [], TEXTS)
    status, answer = _post(server, "/v1/rerank", {"model": "clip", "query": TEXTS[0], "documents": TEXTS[1:]})
    assert status == 200, answer
    expected = _cosines_to(library_texts[0], library_texts[1:])
    results = answer["results"]
    _ranked_as_expected([r["index"] for r in results], [r["relevance_score"] for r in results], expected)


@pytest.mark.parametrize(
    ("route", "body", "refusal"),
    [
        (
            "/v1/rerank",
            {"model": "clip", "query": "a cat", "documents": ["a dog", {"image": "https://example.com/a.png"}]},
            (400, "documents[1].image is a URL: this server does not fetch remote images"),
        ),
        (
            "/v1/rerank",
            {"model": "clip", "query": "a cat", "documents": ["a dog", {"image": NOT_AN_IMAGE}]},
            (400, "documents[1] is not a PNG, JPEG, WebP or GIF image"),
        ),
        (
            "/v1/rerank",
            {"model": "clip", "query": "a cat", "documents": ["a dog", {"audio": "abc"}]},
            (400, "documents[1] must be a string or an object"),
        ),
        (
            "/rerank",
            {"model": "clip", "query": {"image": NOT_AN_IMAGE}, "texts": ["a dog", {"image": "{good}"}]},
            (422, "query is not a PNG, JPEG, WebP or GIF image"),
        ),
        (
            "/rerank",
            {"model": DEFAULT_MODEL, "query": {"image": "{good}"}, "texts": ["a dog"]},
            (422, f"model {DEFAULT_MODEL} is a embed model; this route needs a two-tower (text and image) embed model"),
        ),
        (
            "/rerank",
            {"query": {"image": "{good}"}, "texts": ["a dog"]},
            (422, "several two-tower (text and image) embed models are served"),
        ),
        (
            "/similarity",
            {"model": "clip", "inputs": {"source_sentence": "a cat", "sentences": ["a", {"image": NOT_AN_IMAGE}]}},
            (422, "inputs.sentences[1] is not a PNG, JPEG, WebP or GIF image"),
        ),
        (
            "/similarity",
            {"model": "clip", "inputs": {"source_sentence": {"image": "data:image/png,abc"}, "sentences": ["a"]}},
            (422, "inputs.source_sentence.image: a data: URI must hold base64"),
        ),
    ],
    ids=[
        "URL document",
        "not an image document",
        "unknown document kind",
        "not an image query",
        "text-only model",
        "several two-tower models",
        "not an image sentence",
        "data: URI without base64",
    ],
)
def test_scores_refuse_a_bad_item_by_its_place(
    server: RunningServer, exported: Path, route: str, body: dict, refusal: tuple[int, str]
) -> None:
    status, message = refusal
    good = base64.b64encode(_images(exported, "clip")[0]).decode()
    answered, answer = _post(server, route, _filled(body, good))
    assert answered == status, answer
    text = answer.get("message") or answer.get("error")
    assert message in text
