"""Images counted as their own unit on /metrics (encoder_images_total, encoder_image_bytes_total), through a real
server answering tritonclient over gRPC; refused images only in encoder_requests_rejected_total. A request that
mixes texts and images over HTTP (OpenAI's, Cohere's `inputs`) runs in two parts and is one request: counted once,
its tenant admitted once and charged its texts' tokens."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from PIL import Image
from tritonclient.utils import InferenceServerException

from tests.export.two_tower_folders import exported_two_towers
from tests.servers import RunningServer, metric_samples, metric_value, post_json, start_server

MODEL = "clip"
LABELS = {"model": MODEL, "version": "1"}
TENANT_KEY = "k-one-request"
TENANTS = f"""
# One request, then none for a thousand seconds: a request admitted twice is refused its second part.
[tenants.mixed]
keys = ["{TENANT_KEY}"]
requests_per_second = 0.001
requests_burst = 1
"""


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


@pytest.mark.parametrize("route", ["/v1/embeddings", "/v2/embed"])
def test_a_request_of_texts_and_images_counts_once_and_is_charged_once(route: str, tmp_path: Path) -> None:
    image = "data:image/png;base64," + base64.b64encode(_png(40, 30, (200, 10, 10))).decode()
    if route == "/v1/embeddings":
        body = {"model": MODEL, "input": [{"text": "a photo of a cat"}, {"image": image}, "two dogs"]}
    else:
        parts = [[{"type": "text", "text": "a photo of a cat"}], [{"type": "image_url", "image_url": image}]]
        inputs = [{"content": content} for content in parts]
        body = {"model": MODEL, "inputs": inputs, "input_type": "search_document", "embedding_types": ["float"]}
    keys = tmp_path / "keys.toml"
    keys.write_text(TENANTS, encoding="utf-8")
    repository = tmp_path / "repository"
    repository.mkdir()
    (repository / MODEL).symlink_to(exported_two_towers() / "repository" / MODEL)
    with start_server(repository, tmp_path / "server.log", "--api-key-file", str(keys)) as server:
        status, answer = post_json(server, route, body, {"authorization": f"Bearer {TENANT_KEY}"})
        assert status == 200, answer
        after = metric_samples(server)
    assert metric_value(after, "encoder_requests_total", code="OK", **LABELS) == 1
    assert metric_value(after, "encoder_tenant_requests_total", tenant="mixed", code="OK") == 1
    assert metric_value(after, "encoder_images_total", **LABELS) == 1
    # The texts' tokens, as the answer bills them: an image is no token.
    billed = answer["usage"]["prompt_tokens"] if route == "/v1/embeddings" else answer["meta"]["billed_units"]
    if route == "/v2/embed":
        assert billed["images"] == 1
        billed = billed["input_tokens"]
    assert metric_value(after, "encoder_tenant_prompt_tokens_total", tenant="mixed") == billed > 0
