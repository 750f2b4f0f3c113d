"""Request building and response parsing for the KServe v2 protocol, shared by the clients."""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence

import grpc
import numpy as np

from protocol import grpc_service_pb2 as pb

_LENGTH = struct.Struct("<I")
# Inference is idempotent: retry what a draining or restarting pod answers (UNAVAILABLE).
RETRY_POLICY = {
    "name": [{"service": "inference.GRPCInferenceService"}],
    "retryPolicy": {
        "maxAttempts": 3,
        "initialBackoff": "0.05s",
        "maxBackoff": "0.5s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE"],
    },
}


class EmbeddingError(Exception):
    """The server refused or failed a request; `code` is the gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


def channel_options(target: str, max_message_bytes: int) -> list[tuple[str, object]]:
    """Channel arguments: UNAVAILABLE retried; `dns:///` targets balanced round-robin.

    A `dns:///` name of a headless Kubernetes Service resolves to every ready pod.
    """
    service_config: dict[str, object] = {"methodConfig": [RETRY_POLICY]}
    if target.startswith("dns:"):
        service_config["loadBalancingConfig"] = [{"round_robin": {}}]
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.service_config", json.dumps(service_config)),
    ]


def text_request(model: str, texts: Sequence[str], outputs: Sequence[str] = ("embedding",)) -> pb.ModelInferRequest:
    """A ModelInferRequest carrying texts as one BYTES input in raw form."""
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="text", datatype="BYTES", shape=[len(texts)])
    encoded = [text.encode("utf-8") for text in texts]
    request.raw_input_contents.append(b"".join(_LENGTH.pack(len(item)) + item for item in encoded))
    for name in outputs:
        request.outputs.add(name=name)
    return request


def token_request(model: str, input_ids: np.ndarray, attention_mask: np.ndarray) -> pb.ModelInferRequest:
    """A ModelInferRequest carrying token ids and mask (int64 [batch, sequence]) in raw form."""
    request = pb.ModelInferRequest(model_name=model)
    for name, array in (("input_ids", input_ids), ("attention_mask", attention_mask)):
        request.inputs.add(name=name, datatype="INT64", shape=list(array.shape))
        request.raw_input_contents.append(np.ascontiguousarray(array, dtype="<i8").tobytes())
    request.outputs.add(name="embedding")
    return request


def output_array(response: pb.ModelInferResponse, name: str) -> np.ndarray:
    """One FP32 output of a response as a numpy array."""
    for index, output in enumerate(response.outputs):
        if output.name == name:
            if output.datatype != "FP32":
                raise EmbeddingError(grpc.StatusCode.INTERNAL, f"output {name} is {output.datatype}, expected FP32")
            return np.frombuffer(response.raw_output_contents[index], dtype="<f4").reshape(list(output.shape))
    raise EmbeddingError(grpc.StatusCode.INTERNAL, f"response has no output {name!r}")


def batches(texts: Sequence[str], batch_size: int) -> list[Sequence[str]]:
    """Texts in request-sized slices."""
    return [texts[start : start + batch_size] for start in range(0, len(texts), batch_size)]
