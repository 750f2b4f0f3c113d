"""A two-tower model's `image` input served over gRPC and KServe v2 REST: images answer as the library that made
the folder (get_image_features with the folder's processor, or sentence-transformers' encode of PIL images), through
tritonclient against a real server on loopback; each bad input is refused INVALID_ARGUMENT naming the image, and
the server goes on answering. The repository holds tests.export.two_tower_folders' shared export and the default
(text-only) model. Listed in the Makefile's MULTIPROCESS_SUITES: it runs again with two front ends.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import struct
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from PIL import Image
from tritonclient.utils import InferenceServerException

from export.gate.image_cases import image_cases
from service.core.fidelity import FIDELITY_MIN_COSINE, cosines
from service.core.repository import read_model
from service.pipeline.images import ImagePreprocessor
from tests.conftest import DEFAULT_MODEL
from tests.export.two_tower_folders import SOURCES, exported_two_towers, library_embeddings
from tests.servers import RunningServer, start_server

SERVED_MAX_ABS_DIFF = 1e-4
MAX_IMAGE_BYTES = 100_000
"""The server's --max-image-bytes: above every gate image, below `_too_many_bytes`."""


def _encoded(image: Image.Image, image_format: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=image_format)
    return buffer.getvalue()


def _noise(width: int, height: int) -> Image.Image:
    values = np.random.default_rng(7).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    return Image.fromarray(values, mode="RGB")


def _forged_png(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height pixels (its data is a 1x1 image's): a decompression bomb's shape."""
    data = bytearray(_encoded(Image.new("RGB", (1, 1)), "PNG"))
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


@pytest.fixture(scope="module")
def exported() -> Path:
    """source/<name> and the repository they were exported into."""
    return exported_two_towers()


@pytest.fixture(scope="module")
def server(
    exported: Path, default_repository: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    """The two-tower models and the default text-only model in one repository (links to the shared folders)."""
    repository = tmp_path_factory.mktemp("image-repository")
    for name in SOURCES:
        (repository / name).symlink_to(exported / "repository" / name)
    (repository / DEFAULT_MODEL).symlink_to(default_repository / DEFAULT_MODEL)
    log = repository.parent / "server.log"
    with start_server(repository, log, "--max-image-bytes", str(MAX_IMAGE_BYTES)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[grpcclient.InferenceServerClient]:
    with grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}") as connected:
        yield connected


def _image_input(images: list[bytes]) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput("image", [len(images)], "BYTES")
    tensor.set_data_from_numpy(np.array(images, dtype=object))
    return tensor


def _embeddings(client: grpcclient.InferenceServerClient, model: str, images: list[bytes], **options) -> np.ndarray:
    answer = client.infer(model, [_image_input(images)], **options)
    return next(answer.as_numpy(output.name) for output in answer.get_response().outputs)


def _refusal(client: grpcclient.InferenceServerClient, model: str, inputs: list[grpcclient.InferInput]) -> str:
    """The message of a request refused INVALID_ARGUMENT."""
    with pytest.raises(InferenceServerException) as refused:
        client.infer(model, inputs)
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
    return refused.value.message()


def _post(server: RunningServer, path: str, body: dict) -> tuple[int, dict]:
    """POST a JSON body to the HTTP port: the status and the JSON answer."""
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    try:
        connection.request("POST", path, json.dumps(body), {"content-type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def _gate_images(exported: Path, name: str) -> list[bytes]:
    """The gate's images at the model's size: other sizes, portrait, landscape, grey, RGBA, a transparent PNG."""
    size = ImagePreprocessor.from_folder(exported / "repository" / name).output_size
    return [case.data for case in image_cases(size.height)]


@pytest.mark.parametrize("name", SOURCES)
def test_images_answer_as_the_library(client: grpcclient.InferenceServerClient, exported: Path, name: str) -> None:
    images = _gate_images(exported, name)
    spec = read_model(exported / "repository" / name)
    expected, _ = library_embeddings(exported / "source" / name, images, [], spec.text_padding)
    served = _embeddings(client, name, images, outputs=[grpcclient.InferRequestedOutput("embedding")])
    assert served.shape == tuple(expected.shape)
    assert np.abs(served - expected.numpy()).max() <= SERVED_MAX_ABS_DIFF
    assert cosines(served, expected.numpy()).min() >= FIDELITY_MIN_COSINE


def test_an_image_alone_answers_as_in_a_batch(client: grpcclient.InferenceServerClient, exported: Path) -> None:
    """Rows are rows: an image's embedding does not depend on the requests it was batched with."""
    images = _gate_images(exported, "siglip")
    together = _embeddings(client, "siglip", images)
    alone = np.stack([_embeddings(client, "siglip", [image])[0] for image in images[:3]])
    np.testing.assert_allclose(alone, together[:3], atol=1e-5)


def test_dense_output_kinds_apply_to_images(client: grpcclient.InferenceServerClient, exported: Path) -> None:
    images = _gate_images(exported, "clip")
    full = _embeddings(client, "clip", images)
    binary = _embeddings(client, "clip", images, outputs=[grpcclient.InferRequestedOutput("embedding_ubinary")])
    assert binary.dtype == np.uint8
    np.testing.assert_array_equal(binary, np.packbits(full > 0, axis=-1))


def test_metadata_and_config_list_the_image_input(client: grpcclient.InferenceServerClient) -> None:
    metadata = client.get_model_metadata("clip")
    inputs = {tensor.name: tensor.datatype for tensor in metadata.inputs}
    assert inputs["image"] == "BYTES"
    assert inputs["text"] == "BYTES"
    outputs = {tensor.name for tensor in metadata.outputs}
    assert "embedding" in outputs
    assert not outputs & {"chunk_embeddings", "chunk_counts"}
    config = client.get_model_config("clip").config
    assert "image" in {tensor.name for tensor in config.input}
    assert not {tensor.name for tensor in config.output} & {"chunk_embeddings", "chunk_counts"}
    text_only = {tensor.name for tensor in client.get_model_metadata(DEFAULT_MODEL).inputs}
    assert "image" not in text_only


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (b"", "input image[1] is empty (0 bytes)"),
        (b"these bytes are not an image", "image 1 is not a PNG, JPEG, WebP or GIF image"),
        (_encoded(_noise(40, 30), "BMP"), "image 1 is not a PNG, JPEG, WebP or GIF image"),
        (_encoded(_noise(300, 200), "PNG")[:2000], "image 1: its PNG data does not decode"),
        (_encoded(_noise(300, 200), "JPEG")[:3000], "image 1: its JPEG data does not decode"),
        (_forged_png(20000, 20000), "image 1: over the limit of 50000000 pixels"),
        (_forged_png(8000, 7000), "image 1 is 8000x7000 pixels, over the limit of 50000000 pixels"),
        (_encoded(_noise(300, 300), "PNG"), f"over the limit of {MAX_IMAGE_BYTES} bytes per image (--max-image-bytes)"),
    ],
    ids=[
        "empty",
        "not an image",
        "BMP",
        "truncated PNG",
        "truncated JPEG",
        "bomb",
        "too many pixels",
        "too many bytes",
    ],
)
def test_a_bad_image_is_refused_by_its_index(
    client: grpcclient.InferenceServerClient, exported: Path, bad: bytes, message: str
) -> None:
    """The request is refused naming the image and why; the next request (the same good images) is answered."""
    good = _gate_images(exported, "clip")[:2]
    assert message in _refusal(client, "clip", [_image_input([good[0], bad, good[1]])])
    assert _embeddings(client, "clip", good).shape == (2, 24)


def test_a_bad_image_costs_no_other_request_its_answer(server: RunningServer, exported: Path) -> None:
    """Good and bad requests at once, from several clients: each good one answers as it would alone."""
    images = _gate_images(exported, "clip")
    with grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}") as alone:
        expected = _embeddings(alone, "clip", images)

    def ask(index: int) -> np.ndarray | str:
        with grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}") as own:
            if index % 3 == 0:
                return _refusal(own, "clip", [_image_input([images[0], b"not an image"])])
            return _embeddings(own, "clip", [images[index % len(images)]])

    with ThreadPoolExecutor(max_workers=9) as pool:
        answers = list(pool.map(ask, range(18)))
    for index, answer in enumerate(answers):
        if index % 3 == 0:
            assert "image 1 is not a PNG, JPEG, WebP or GIF image" in answer
        else:
            np.testing.assert_allclose(answer[0], expected[index % len(images)], atol=1e-5)


def test_image_requests_take_the_scheduling_parameters(
    client: grpcclient.InferenceServerClient, exported: Path
) -> None:
    """A row is a row: an image request waits at its priority and honours its timeout, as a text request does."""
    images = _gate_images(exported, "clip")[:2]
    expected = _embeddings(client, "clip", images)
    bulk = _embeddings(client, "clip", images, priority=2, timeout=10_000_000)
    np.testing.assert_allclose(bulk, expected, atol=1e-6)
    with pytest.raises(InferenceServerException, match="parameter priority must be an integer from 1"):
        client.infer("clip", [_image_input(images)], priority=9)


def test_images_and_texts_go_in_separate_requests(client: grpcclient.InferenceServerClient, exported: Path) -> None:
    text = grpcclient.InferInput("text", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"a photo of a cat"], dtype=object))
    image = _image_input(_gate_images(exported, "clip")[:1])
    assert "input image cannot be combined with input text" in _refusal(client, "clip", [image, text])


def test_an_image_on_a_text_only_model_is_refused(client: grpcclient.InferenceServerClient, exported: Path) -> None:
    image = _image_input(_gate_images(exported, "clip")[:1])
    assert "input image: this model has no image tower" in _refusal(client, DEFAULT_MODEL, [image])


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_kserve_rest_images_answer_as_grpc(
    server: RunningServer, client: grpcclient.InferenceServerClient, exported: Path, binary: bool
) -> None:
    """Binary tensor data carries the images as they are; JSON data as base64 (tritonclient.http's own encoding)."""
    images = _gate_images(exported, "siglip")
    expected = _embeddings(client, "siglip", images)
    with httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}") as rest:
        if binary:
            tensor = httpclient.InferInput("image", [len(images)], "BYTES")
            tensor.set_data_from_numpy(np.array(images, dtype=object), binary_data=True)
            served = rest.infer("siglip", [tensor]).as_numpy("embedding")
        else:
            data = [base64.b64encode(image).decode() for image in images]
            body = {"inputs": [{"name": "image", "shape": [len(images)], "datatype": "BYTES", "data": data}]}
            status, answer = _post(server, "/v2/models/siglip/infer", body)
            assert status == 200
            output = answer["outputs"][0]
            served = np.array(output["data"], dtype=np.float32).reshape(output["shape"])
    np.testing.assert_allclose(served, expected, atol=1e-6)


@pytest.mark.parametrize(
    ("element", "message"),
    [
        ("not base64!", "input image[0] is not base64"),
        ("https://example.com/cat.png", "input image[0] is a URL: this server does not fetch remote images"),
        (base64.b64encode(b"GIF89a but cut").decode(), "image 0 is not a PNG, JPEG, WebP or GIF image"),
    ],
    ids=["not base64", "URL", "not an image"],
)
def test_kserve_rest_bad_images_are_400_naming_the_image(server: RunningServer, element: str, message: str) -> None:
    body = {"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES", "data": [element]}]}
    status, answer = _post(server, "/v2/models/clip/infer", body)
    assert status == 400
    assert message in answer["error"]


def test_openai_mixes_texts_and_images_in_the_inputs_order(
    server: RunningServer, client: grpcclient.InferenceServerClient, exported: Path
) -> None:
    """Jina's convention: {"text": ...} and {"image": base64 or data: URI} items (and plain strings) in one list."""
    images = _gate_images(exported, "clip")[:2]
    texts = ["a photo of a cat", "x"]
    text = grpcclient.InferInput("text", [len(texts)], "BYTES")
    text.set_data_from_numpy(np.array([item.encode() for item in texts], dtype=object))
    expected_texts = client.infer("clip", [text]).as_numpy("embedding")
    expected_images = _embeddings(client, "clip", images)
    items = [
        {"image": base64.b64encode(images[0]).decode()},
        {"text": texts[0]},
        {"image": "data:image/png;base64," + base64.b64encode(images[1]).decode()},
        texts[1],
    ]
    status, answer = _post(server, "/v1/embeddings", {"model": "clip", "input": items})
    assert status == 200
    served = np.array([item["embedding"] for item in sorted(answer["data"], key=lambda item: item["index"])])
    expected = np.stack([expected_images[0], expected_texts[0], expected_images[1], expected_texts[1]])
    np.testing.assert_allclose(served, expected, atol=1e-6)


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ({"image": "https://example.com/cat.png"}, "input[1].image is a URL: this server does not fetch remote images"),
        ({"image": "data:text/plain;base64,aGk="}, "input[1].image: data: URI of type 'text/plain', not an image"),
        ({"image": base64.b64encode(b"not an image").decode()}, "input[1] is not a PNG, JPEG, WebP or GIF image"),
        ({"text": ""}, "input[1] is empty"),
        ({"audio": "abc"}, "input[1]: an item is a string"),
    ],
    ids=["URL", "not an image type", "not an image", "empty text", "unknown kind"],
)
def test_openai_refuses_a_bad_item_by_its_place(
    server: RunningServer, exported: Path, item: dict, message: str
) -> None:
    items = [{"text": "a cat"}, item, {"image": base64.b64encode(_gate_images(exported, "clip")[0]).decode()}]
    status, answer = _post(server, "/v1/embeddings", {"model": "clip", "input": items})
    assert status == 400
    assert message in answer["error"]["message"]


def test_cohere_embeds_images_as_data_uris(
    server: RunningServer, client: grpcclient.InferenceServerClient, exported: Path
) -> None:
    images = _gate_images(exported, "siglip")[:3]
    expected = _embeddings(client, "siglip", images)
    uris = ["data:image/png;base64," + base64.b64encode(image).decode() for image in images]
    body = {"model": "siglip", "images": uris, "input_type": "image", "embedding_types": ["float"]}
    status, answer = _post(server, "/v2/embed", body)
    assert status == 200
    np.testing.assert_allclose(np.array(answer["embeddings"]["float"]), expected, atol=1e-6)
    status, answer = _post(server, "/v2/embed", body | {"images": ["https://example.com/cat.png"]})
    assert status == 400
    assert "images[0] is a URL: this server does not fetch remote images" in answer["message"]
    status, answer = _post(server, "/v2/embed", body | {"texts": ["a cat"]})
    assert status == 400
    assert "send texts or images, not both" in answer["message"]
