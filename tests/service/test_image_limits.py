"""An image is bounded by --max-image-bytes, not first by the transport's message limit, on every transport.

A server that serves a model with an image tower receives a request that carries one image of --max-image-bytes
(service.ops.message_limits): over gRPC on grpcio and on Envoy, and over HTTP (its base64). Here --max-image-bytes
(2.5 MiB) is above the default --max-message-bytes (2 MiB): an image between the two is answered, an image just
over --max-image-bytes gets the image's own refusal (INVALID_ARGUMENT naming it; HTTP 413), not the transport's
RESOURCE_EXHAUSTED, and a gRPC message past the raised limit (an image far over its own) the message limit's. The
repository holds tests.export.two_tower_folders' shared CLIP export.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from PIL import Image

from protocol import grpc_service_pb2 as pb
from protocol import grpc_service_pb2_grpc as pb_grpc
from service.launch.envoy import unusable_reason
from service.ops.message_limits import ReceiveLimits
from service.ops.settings import Settings
from tests.export.two_tower_folders import PROJECTION, exported_two_towers
from tests.servers import RunningServer, post_json, start_server

MODEL = "clip"
MAX_IMAGE_BYTES = 5 * 512 * 1024
"""--max-image-bytes of the server here: 2.5 MiB, above the default --max-message-bytes (2 MiB)."""
MESSAGE_BYTES = Settings().max_message_bytes


def _noise_png(side: int) -> bytes:
    """A PNG of random pixels (which PNG cannot compress): about 3 x side x side bytes."""
    values = np.random.default_rng(side).integers(0, 256, size=(side, side, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(values, mode="RGB").save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def images() -> dict[str, bytes]:
    """An image over the default message limit and under --max-image-bytes, one just over --max-image-bytes (its
    size is checked before it is decoded), and one far over it.
    """
    made = {"between": _noise_png(870), "over": bytes(MAX_IMAGE_BYTES + 1), "far over": _noise_png(1024)}
    assert MESSAGE_BYTES < len(made["between"]) < MAX_IMAGE_BYTES < len(made["over"])
    assert len(made["far over"]) > ReceiveLimits.of(Settings(max_image_bytes=MAX_IMAGE_BYTES), True).grpc_bytes
    return made


@pytest.fixture(scope="module", params=["grpcio", "envoy"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """The shared tiny CLIP export alone, on each gRPC transport."""
    transport = request.param
    if transport == "envoy" and (reason := unusable_reason()) is not None:
        pytest.skip(f"Envoy front ends cannot start here: {reason}")
    repository = tmp_path_factory.mktemp(f"image-limits-{transport}")
    (repository / MODEL).symlink_to(exported_two_towers() / "repository" / MODEL)
    flags = ("--grpc-transport", transport, "--max-image-bytes", str(MAX_IMAGE_BYTES))
    with start_server(repository, repository.parent / "server.log", *flags) as running:
        yield running


def _infer(server: RunningServer, image: bytes) -> pb.ModelInferResponse:
    request = pb.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="image", datatype="BYTES", shape=[1]).contents.bytes_contents.append(image)
    request.outputs.add(name="embedding")
    with grpc.insecure_channel(server.target, options=[("grpc.max_send_message_length", -1)]) as channel:
        return pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=60)


def _embed_over_http(server: RunningServer, image: bytes) -> tuple[int, dict]:
    body = {"model": MODEL, "input": [{"image": base64.b64encode(image).decode()}]}
    return post_json(server, "/v1/embeddings", body)


def test_an_image_over_the_message_limit_and_within_its_own_is_answered(
    server: RunningServer, images: dict[str, bytes]
) -> None:
    assert _infer(server, images["between"]).outputs[0].shape == [1, PROJECTION]
    status, answer = _embed_over_http(server, images["between"])
    assert status == 200, answer
    assert len(answer["data"][0]["embedding"]) == PROJECTION


def test_an_image_over_its_limit_gets_the_image_refusal_not_the_transports(
    server: RunningServer, images: dict[str, bytes]
) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        _infer(server, images["over"])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "bytes per image (--max-image-bytes)" in refused.value.details()
    status, answer = _embed_over_http(server, images["over"])
    assert status == 413
    assert "bytes per image (--max-image-bytes)" in answer["error"]["message"]


def test_a_request_past_the_raised_limit_gets_the_message_limits_refusal(
    server: RunningServer, images: dict[str, bytes]
) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        _infer(server, images["far over"])
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "Received message larger than max" in refused.value.details()


def test_a_text_only_server_receives_the_message_limit_as_set() -> None:
    settings = Settings(max_message_bytes=4096, max_image_bytes=MAX_IMAGE_BYTES)
    assert ReceiveLimits.of(settings, takes_images=False) == ReceiveLimits(4096, 4096)
    raised = ReceiveLimits.of(settings, takes_images=True)
    assert raised.grpc_bytes > MAX_IMAGE_BYTES
    assert raised.http_bytes > len(base64.b64encode(bytes(MAX_IMAGE_BYTES)))
