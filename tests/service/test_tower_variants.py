"""A two-tower model served with `--variant int8`: both towers answer from their int8 graphs, within int8's bar of
the model (the library on the source folder), through tritonclient against a real server on loopback. The model is
tests.export.two_tower_folders' shared CLIP export.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from export.gate.image_cases import image_cases
from service.core.fidelity import VARIANT_MIN_COSINE, cosines
from service.core.repository import read_model
from tests.export.two_tower_folders import CLIP_IMAGE_SIZE, exported_two_towers, library_embeddings
from tests.servers import RunningServer, start_server

MODEL = "clip"
TEXTS = ["a photo of a cat", "Two dogs play in the snow near a red barn.", "x"]
FP32_MAX_ABS_DIFF = 1e-4
"""What fp32 serves within (the issue's bound): an answer further from the library than this is not fp32's."""


@pytest.fixture(scope="module")
def exported() -> Path:
    return exported_two_towers()


@pytest.fixture(scope="module")
def server(exported: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """The shared tiny CLIP export alone, served in int8."""
    repository = tmp_path_factory.mktemp("tower-variants")
    (repository / MODEL).symlink_to(exported / "repository" / MODEL)
    with start_server(repository, repository.parent / "server.log", "--variant", "int8") as running:
        yield running


def _served(server: RunningServer, name: str, items: list[bytes]) -> np.ndarray:
    tensor = grpcclient.InferInput(name, [len(items)], "BYTES")
    tensor.set_data_from_numpy(np.array(items, dtype=object))
    with grpcclient.InferenceServerClient(server.target) as client:
        return client.infer(MODEL, [tensor]).as_numpy("embedding")


def test_both_towers_serve_int8_within_its_bar(server: RunningServer, exported: Path) -> None:
    images = [case.data for case in image_cases(CLIP_IMAGE_SIZE + 3, seed=11)]
    spec = read_model(exported / "repository" / MODEL)
    expected_images, expected_texts = library_embeddings(exported / "source" / MODEL, images, TEXTS, spec.text_padding)
    served = {
        "image": (_served(server, "image", images), expected_images.numpy()),
        "text": (_served(server, "text", [text.encode() for text in TEXTS]), expected_texts.numpy()),
    }
    for got, expected in served.values():
        assert got.shape == expected.shape
        assert cosines(got, expected).min() >= VARIANT_MIN_COSINE["int8"]
        assert np.abs(got - expected).max() > FP32_MAX_ABS_DIFF  # int8's answers, not fp32's
