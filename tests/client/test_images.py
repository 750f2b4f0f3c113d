"""Images through the SDK and `python -m client embed`, against a real server of the tiny two-tower models.

The SDK (blocking and asyncio) sends bytes, paths and PIL images, mixed with texts in one call, and its
answers equal the library that made the folder (tests.export.two_tower_folders' `library_embeddings`); a bad
item is refused naming its place in the call. Its rerank with a two-tower model takes an image query or image
documents and ranks by the cosines of the library's vectors. The ingestion embeds a folder of images, image
files in the order given, a Parquet column of paths, and a JSONL column of paths resumed after a SIGKILL of the
client: each row equals its own image's reference vector, and every image is embedded once across both runs.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from client import AsyncEmbeddingClient, EmbeddingClient, InvalidRequest, MessageTooLarge
from client.__main__ import main
from client.images import IMAGE_REQUEST_BYTES, encoded_image, image_batches
from client.tasks import ModelInfo, rerank_requests
from export.gate.image_cases import image_cases
from service.core.fidelity import FIDELITY_MIN_COSINE, cosines
from service.core.repository import read_model
from service.pipeline.images import ImagePreprocessor
from tests.client.test_ingest import cli, finished, killed_after_a_checkpoint
from tests.export.two_tower_folders import exported_two_towers, library_embeddings
from tests.servers import RunningServer, start_server

SERVED_MAX_ABS_DIFF = 1e-4
TEXTS = ["a photo of a cat", "Two dogs play in the snow near a red barn."]
DISTINCT = 40
"""Distinct images in the ingestion's inputs; each file holds one of them."""
FILES = 3000
"""Image files in the resumed ingestion: one a request, it is far from done when its first checkpoint is saved."""


@pytest.fixture(scope="module")
def exported() -> Path:
    """source/<name> and the repository they were exported into."""
    return exported_two_towers()


@pytest.fixture(scope="module")
def server(exported: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with start_server(exported / "repository", tmp_path_factory.mktemp("image-client") / "server.log") as running:
        yield running


def gate_images(exported: Path, name: str) -> list[bytes]:
    """The gate's images at the model's size: other sizes, portrait, landscape, grey, RGBA, a transparent PNG, GIF."""
    size = ImagePreprocessor.from_folder(exported / "repository" / name).output_size
    return [case.data for case in image_cases(size.height)]


def reference(exported: Path, name: str, images: list[bytes], texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The library's image and text embeddings on the model's own folder."""
    padding = read_model(exported / "repository" / name).text_padding
    expected_images, expected_texts = library_embeddings(exported / "source" / name, images, texts, padding)
    return expected_images.numpy(), expected_texts.numpy()


def assert_as_the_library(served: np.ndarray, expected: np.ndarray) -> None:
    assert served.shape == expected.shape and served.dtype == np.float32
    assert np.abs(served - expected).max() <= SERVED_MAX_ABS_DIFF
    assert cosines(served, expected).min() >= FIDELITY_MIN_COSINE


def mixed_inputs(images: list[bytes], folder: Path) -> tuple[list[object], list[tuple[str, int]]]:
    """Texts and images in every form, interleaved; and what each item is (kind, index)."""
    folder.mkdir(parents=True, exist_ok=True)
    inputs: list[object] = []
    kinds: list[tuple[str, int]] = []
    for index, image in enumerate(images):
        form = index % 3
        if form == 0:
            inputs.append(image)
        elif form == 1:
            path = folder / f"image-{index}"
            path.write_bytes(image)
            inputs.append(path)
        else:
            inputs.append(Image.open(io.BytesIO(image)))
        kinds.append(("image", index))
        if index < len(TEXTS):
            inputs.append(TEXTS[index])
            kinds.append(("text", index))
    return inputs, kinds


@pytest.mark.parametrize("name", ["clip", "siglip", "st-clip"])
def test_the_sdk_embeds_bytes_paths_and_pil_images_with_texts_as_the_library(
    server: RunningServer, exported: Path, tmp_path: Path, name: str
) -> None:
    images = gate_images(exported, name)
    expected_images, expected_texts = reference(exported, name, images, TEXTS)
    inputs, kinds = mixed_inputs(images, tmp_path)
    expected = np.stack([(expected_images if kind == "image" else expected_texts)[index] for kind, index in kinds])
    with EmbeddingClient(server.target, model=name, batch_size=4) as client:  # several requests of each kind
        served = client.embed(inputs)
        assert_as_the_library(served, expected)
        images_alone = client.embed([Image.open(io.BytesIO(image)) for image in images])
        assert_as_the_library(images_alone, expected_images)
        bits = client.embed(inputs, embedding_type="ubinary")
        np.testing.assert_array_equal(bits, np.packbits(served > 0, axis=-1))


async def test_the_asyncio_sdk_embeds_images_as_the_blocking_one(
    server: RunningServer, exported: Path, tmp_path: Path
) -> None:
    images = gate_images(exported, "siglip")
    expected_images, expected_texts = reference(exported, "siglip", images, TEXTS)
    inputs, kinds = mixed_inputs(images, tmp_path)
    expected = np.stack([(expected_images if kind == "image" else expected_texts)[index] for kind, index in kinds])
    async with AsyncEmbeddingClient(server.target, model="siglip", batch_size=2, connections=2) as client:
        assert_as_the_library(await client.embed(inputs), expected)
        assert_as_the_library(await client.embed([tmp_path / "image-1"]), expected_images[1:2])


def test_a_bad_image_is_refused_naming_its_place_in_the_call(server: RunningServer, exported: Path) -> None:
    good = gate_images(exported, "clip")[:3]
    inputs = [TEXTS[0], good[0], good[1], TEXTS[1], good[2], b"these bytes are not an image"]
    with EmbeddingClient(server.target, model="clip", batch_size=2) as client:
        with pytest.raises(InvalidRequest) as refused:
            client.embed(inputs)  # the bad image is image 1 of the second image request
        assert refused.value.message.startswith("inputs[5]: image 1 is not a PNG, JPEG, WebP or GIF image")
        with pytest.raises(InvalidRequest, match=r": inputs\[1\]: input text\[0\] is empty"):
            client.embed([good[0], ""])
        assert client.retries == 0


def test_an_image_past_the_servers_message_limit_is_not_retried(server: RunningServer) -> None:
    # A server with an image tower receives an image of --max-image-bytes (20 MiB) in a message: past it, the
    # message limit answers (service.ops.message_limits).
    with EmbeddingClient(server.target, model="clip") as client:
        with pytest.raises(MessageTooLarge, match="Received message larger than max"):
            client.embed([bytes(21 * 1024 * 1024)])
        assert client.retries == 0


def _cosine_ranked(query: np.ndarray, documents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The documents' order, best first, and their cosines with the query (the library's vectors, in float64)."""
    unit = documents.astype(np.float64) / np.linalg.norm(documents, axis=1, keepdims=True)
    scores = unit @ (query.astype(np.float64) / np.linalg.norm(query))
    order = np.argsort(-scores, kind="stable")
    return order, scores[order]


@pytest.mark.parametrize("name", ["clip", "siglip"])
def test_the_sdk_reranks_with_an_image_query_or_image_documents_by_the_librarys_cosines(
    server: RunningServer, exported: Path, tmp_path: Path, name: str
) -> None:
    images = gate_images(exported, name)[:4]
    texts = [*TEXTS, "a red square", "x"]
    expected_images, expected_texts = reference(exported, name, images, texts)
    (tmp_path / "query.png").write_bytes(images[0])
    documents = [images[1], tmp_path / "query.png", Image.open(io.BytesIO(images[2])), images[3]]
    with EmbeddingClient(server.target, model=name, batch_size=2) as client:
        assert client.model_info().takes_images
        by_image = client.rerank(tmp_path / "query.png", texts, top_n=3)
        order, scores = _cosine_ranked(expected_images[0], expected_texts)
        np.testing.assert_array_equal(by_image.indices, order[:3])
        np.testing.assert_allclose(by_image.scores, scores[:3], atol=SERVED_MAX_ABS_DIFF)
        of_images = client.rerank(texts[0], documents)
        order, scores = _cosine_ranked(expected_texts[0], expected_images[[1, 0, 2, 3]])
        np.testing.assert_array_equal(of_images.indices, order)
        np.testing.assert_allclose(of_images.scores, scores, atol=SERVED_MAX_ABS_DIFF)
        with pytest.raises(InvalidRequest, match=r"inputs\[2\]: image 1 is not a PNG, JPEG, WebP or GIF image"):
            client.rerank(texts[0], [images[1], b"these bytes are not an image"])


def test_a_reranker_without_an_image_tower_refuses_images_before_sending() -> None:
    reranker = ModelInfo("reranker", ("1",), "classify", {"logits": "FP32"}, None, labels=("relevant",))
    with pytest.raises(ValueError, match="model reranker reranks texts: images need a two-tower"):
        rerank_requests(reranker, "a query", ["a text", b"\x89PNG image bytes"], None, 8)


async def test_the_asyncio_sdk_reranks_images_as_the_blocking_one(server: RunningServer, exported: Path) -> None:
    images = gate_images(exported, "clip")[:3]
    with EmbeddingClient(server.target, model="clip") as blocking:
        expected = blocking.rerank(images[0], [*TEXTS, images[1], images[2]])
    async with AsyncEmbeddingClient(server.target, model="clip") as client:
        ranked = await client.rerank(images[0], [*TEXTS, images[1], images[2]])
    np.testing.assert_array_equal(ranked.indices, expected.indices)
    np.testing.assert_array_equal(ranked.scores, expected.scores)


def test_an_item_neither_text_nor_image_is_refused_and_a_cmyk_image_goes_as_rgb() -> None:
    with pytest.raises(TypeError, match=r"inputs\[2\] is a int: give a text \(str\) or an image"):
        encoded_image(7, 2)  # type: ignore[arg-type]
    cmyk = Image.new("CMYK", (3, 2), (10, 20, 30, 40))
    assert Image.open(io.BytesIO(encoded_image(cmyk, 0))).convert("RGB").tobytes() == cmyk.convert("RGB").tobytes()


def test_image_requests_are_bounded_by_count_and_bytes() -> None:
    half = IMAGE_REQUEST_BYTES // 2
    assert image_batches([10] * 5, batch_size=2) == [range(0, 2), range(2, 4), range(4, 5)]
    assert image_batches([half, half, 1, 3 * half, 1], batch_size=8) == [
        range(0, 2),
        range(2, 3),
        range(3, 4),
        range(4, 5),
    ]
    assert image_batches([], batch_size=8) == []


def write_images(folder: Path, images: list[bytes], order: np.ndarray) -> list[Path]:
    """One file per entry of `order`, holding that distinct image, named so that sorted paths follow `order`."""
    paths = []
    for row, which in enumerate(order):
        path = folder / f"part-{row // 1000}" / f"{row:05d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(images[which])
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def distinct_images() -> list[bytes]:
    """Random RGB images of a few sizes, each PNG-encoded."""
    rng = np.random.default_rng(48)
    images = []
    for index in range(DISTINCT):
        pixels = rng.integers(0, 256, size=(20 + index % 7, 30 + index % 5, 3), dtype=np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels, mode="RGB").save(buffer, format="PNG")
        images.append(buffer.getvalue())
    return images


@pytest.fixture(scope="module")
def distinct_reference(exported: Path, distinct_images: list[bytes]) -> np.ndarray:
    return reference(exported, "clip", distinct_images, [])[0]


def test_the_command_line_embeds_a_folder_in_path_order(
    server: RunningServer, distinct_images: list[bytes], distinct_reference: np.ndarray, tmp_path: Path
) -> None:
    order = np.random.default_rng(1).permutation(np.arange(120) % DISTINCT)
    write_images(tmp_path / "photos", distinct_images, order)
    (tmp_path / "photos" / "notes.txt").write_text("not an image: left out")
    output = tmp_path / "vectors.npy"
    arguments = ["embed", str(tmp_path / "photos"), "--output", str(output), "--target", server.target]
    summary = finished(cli(*arguments, "--model", "clip", "--batch-size", "16"))
    assert summary["rows"] == summary["embedded"] == len(order) and "images_per_s" in summary
    assert_as_the_library(np.load(output), distinct_reference[order])


def test_image_files_in_the_order_given_and_a_parquet_column_of_paths(
    server: RunningServer, distinct_images: list[bytes], distinct_reference: np.ndarray, tmp_path: Path
) -> None:
    order = np.arange(12) % DISTINCT
    paths = write_images(tmp_path / "photos", distinct_images, order)[::-1]  # given last to first
    target = ["--target", server.target, "--model", "clip", "--quiet"]
    listed = tmp_path / "listed.npy"
    assert main(["embed", *map(str, paths), "--output", str(listed), *target]) == 0
    assert_as_the_library(np.load(listed), distinct_reference[order[::-1]])
    table = tmp_path / "photos.parquet"
    pq.write_table(pa.table({"image": [str(path) for path in paths]}), table)  # absolute paths
    from_table = tmp_path / "table.parquet"
    assert main(["embed", str(table), "--image-column", "image", "--output", str(from_table), *target]) == 0
    written = pq.read_table(from_table)
    vectors = np.array(written.column("embedding").to_pylist(), dtype=np.float32)
    assert_as_the_library(vectors, distinct_reference[order[::-1]])


def test_a_jsonl_column_of_paths_resumed_after_sigkill_embeds_every_image_once(
    server: RunningServer, distinct_images: list[bytes], distinct_reference: np.ndarray, tmp_path: Path
) -> None:
    order = np.random.default_rng(2).permutation(np.arange(FILES) % DISTINCT)
    paths = write_images(tmp_path / "photos", distinct_images, order)
    listing = tmp_path / "photos.jsonl"
    listing.write_text(
        "".join(json.dumps({"id": i, "file": str(p.relative_to(tmp_path))}) + "\n" for i, p in enumerate(paths))
    )
    output = tmp_path / "vectors.npy"
    record = tmp_path / "vectors.npy.checkpoint.json"
    arguments = ["embed", str(listing), "--image-column", "file", "--output", str(output), "--target", server.target]
    arguments += ["--model", "clip"]
    recorded = killed_after_a_checkpoint(arguments, record)
    assert not output.exists()
    summary = finished(cli(*arguments, "--resume"))
    # Rows written after the last checkpoint but not recorded in it are done again, and only those.
    assert 0 < recorded < FILES and summary["embedded"] == FILES - recorded and summary["rows"] == FILES
    assert_as_the_library(np.load(output), distinct_reference[order])


@pytest.mark.parametrize(
    ("listing", "message"),
    [
        ('{"file": "missing.png"}\n', "photos.jsonl:1 (missing.png): No such file or directory"),
        ('{"file": "empty.png"}\n', "photos.jsonl:1 (empty.png): empty file"),
        ('{"file": 3}\n', "photos.jsonl:1: 'file' holds no image path (3)"),
        ('{"path": "a.png"}\n', "photos.jsonl:1: not a JSON object with a 'file' field"),
    ],
    ids=["missing", "empty", "not a path", "no field"],
)
def test_a_bad_row_of_paths_is_refused_naming_the_line_before_sending(
    server: RunningServer, tmp_path: Path, capsys: pytest.CaptureFixture[str], listing: str, message: str
) -> None:
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "photos.jsonl").write_text(listing)
    output = tmp_path / "out.npy"
    arguments = ["embed", str(tmp_path / "photos.jsonl"), "--image-column", "file", "--output", str(output)]
    assert main([*arguments, "--target", server.target, "--model", "clip"]) == 1
    assert message in capsys.readouterr().err
    assert not list(tmp_path.glob("out.npy*"))


def test_a_bad_image_fails_the_run_naming_its_file(
    server: RunningServer, distinct_images: list[bytes], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "photos"
    write_images(folder, distinct_images, np.arange(5))
    (folder / "part-0" / "00003.png").write_bytes(b"not a PNG")
    arguments = ["embed", str(folder), "--output", str(tmp_path / "out.npy"), "--target", server.target]
    assert main([*arguments, "--model", "clip", "--quiet"]) == 1
    assert (
        f"{folder / 'part-0' / '00003.png'}: image 3 is not a PNG, JPEG, WebP or GIF image" in capsys.readouterr().err
    )
