"""Images counted as their own unit on /metrics (encoder_images_total, encoder_image_bytes_total), through a real
server answering tritonclient over gRPC; refused images only in encoder_requests_rejected_total."""

from __future__ import annotations

import io
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from PIL import Image
from tritonclient.utils import InferenceServerException

from tests.export.two_tower_folders import exported_two_towers
from tests.servers import RunningServer, metric_samples, metric_value, start_server

MODEL = "clip"
LABELS = {"model": MODEL, "version": "1"}


def _png(width: int, height: int, colour: tuple[int, int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def _infer(client: grpcclient.InferenceServerClient, images: list[bytes]) -> np.ndarray:
    tensor = grpcclient.InferInput("image", [len(images)], "BYTES")
    tensor.set_data_from_numpy(np.array(images, dtype=object))
    return client.infer(MODEL, [tensor]).as_numpy("embedding")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """The shared tiny CLIP export alone (tests.export.two_tower_folders)."""
    repository = tmp_path_factory.mktemp("image-metrics")
    (repository / MODEL).symlink_to(exported_two_towers() / "repository" / MODEL)
    with start_server(repository, repository.parent / "server.log") as running:
        yield running


def test_images_and_their_bytes_are_counted_and_refused_ones_by_reason(server: RunningServer) -> None:
    images = [_png(40, 30, (200, 10, 10)), _png(17, 64, (10, 200, 10)), _png(30, 30, (10, 10, 200))]
    with grpcclient.InferenceServerClient(server.target) as client:
        before = metric_samples(server)
        assert _infer(client, images[:2]).shape[0] == 2
        assert _infer(client, images[2:]).shape[0] == 1
        with pytest.raises(InferenceServerException) as refused:
            _infer(client, [b"not an image at all"])
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
        after = metric_samples(server)

    def moved(name: str, labels: dict[str, str] = LABELS) -> float:
        return metric_value(after, name, **labels) - metric_value(before, name, **labels)

    assert moved("encoder_images_total") == 3
    assert moved("encoder_image_bytes_total") == sum(map(len, images))
    assert moved("encoder_tokenize_duration_seconds_count") == 2  # each answered request's preprocessing
    assert moved("encoder_requests_rejected_total", {"reason": "image_unreadable"}) == 1
    assert moved("encoder_requests_total", {**LABELS, "code": "OK"}) == 2
