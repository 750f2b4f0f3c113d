"""A two-tower repository (CLIP, SigLIP, a sentence-transformers CLIP folder) served over gRPC: texts answer as the
library that made the folder (get_text_features, or sentence-transformers' encode), through tritonclient against
a real server on loopback. The repository is tests.export.two_tower_folders' shared export.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from service.core.fidelity import FIDELITY_MIN_COSINE, cosines
from service.core.repository import read_model
from tests.export.two_tower_folders import SOURCES, exported_two_towers, library_embeddings
from tests.servers import RunningServer, start_server

SERVED_MAX_ABS_DIFF = 1e-4
TEXTS = ["a photo of a cat", "Two dogs play in the snow near a red barn, while a third one sleeps.", "x"]
"""Texts of different lengths in one request (the longest past the models' 16 positions: truncated)."""


@pytest.fixture(scope="module")
def exported() -> Path:
    """source/<name> and the repository they were exported into."""
    return exported_two_towers()


@pytest.fixture(scope="module")
def server(exported: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with start_server(exported / "repository", tmp_path_factory.mktemp("towers") / "server.log") as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[grpcclient.InferenceServerClient]:
    with grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}") as connected:
        yield connected


@pytest.mark.parametrize("name", SOURCES)
def test_texts_answer_as_the_library(client: grpcclient.InferenceServerClient, exported: Path, name: str) -> None:
    spec = read_model(exported / "repository" / name)
    _, expected = library_embeddings(exported / "source" / name, [], TEXTS, spec.text_padding)
    text = grpcclient.InferInput("text", [len(TEXTS)], "BYTES")
    text.set_data_from_numpy(np.array([item.encode() for item in TEXTS], dtype=object))
    answer = client.infer(name, [text], outputs=[grpcclient.InferRequestedOutput("embedding")])
    served = answer.as_numpy("embedding")
    assert served.shape == tuple(expected.shape)
    assert np.abs(served - expected.numpy()).max() <= SERVED_MAX_ABS_DIFF
    assert cosines(served, expected.numpy()).min() >= FIDELITY_MIN_COSINE


def test_late_chunking_is_refused_where_the_graph_pools(client: grpcclient.InferenceServerClient) -> None:
    """A two-tower text graph answers its pooled embedding only: no token states to pool chunks from."""
    text = grpcclient.InferInput("text", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"a document"], dtype=object))
    with pytest.raises(InferenceServerException) as refused:
        client.infer("clip", [text], parameters={"late_chunking": True})
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "model clip pools inside its graph (eos_token) and answers no last_hidden_state" in refused.value.message()
