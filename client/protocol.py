"""Request building and response parsing for the KServe v2 protocol, shared by the clients."""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence

import grpc
import numpy as np

from client.errors import EmbeddingError
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


_DTYPES = {"FP32": np.dtype("<f4"), "INT8": np.dtype("i1"), "UINT8": np.dtype("u1"), "INT64": np.dtype("<i8")}
"""The numpy type of each KServe datatype the server answers."""
Parameter = bool | int | str
"""A request parameter's value (prompt_name, truncate, dimensions, top_k, input_type...)."""

__all__ = [
    "EmbeddingError",
    "Parameter",
    "batches",
    "channel_options",
    "image_request",
    "output_array",
    "output_values",
    "text_request",
    "token_request",
]


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


IMAGE_INPUT = "image"
"""The input a two-tower model takes encoded images in (BYTES, one image an element)."""


def text_request(
    model: str,
    texts: Sequence[str],
    outputs: Sequence[str] = ("embedding",),
    *,
    queries: Sequence[str] | None = None,
    parameters: dict[str, Parameter] | None = None,
    request_id: str = "",
) -> pb.ModelInferRequest:
    """A ModelInferRequest carrying texts (and a pair's queries) as BYTES inputs in raw form, with parameters."""
    named = [("text", texts)] if queries is None else [("query", queries), ("text", texts)]
    inputs = {name: [item.encode("utf-8") for item in items] for name, items in named}
    return _bytes_request(model, inputs, outputs, parameters, request_id)


def image_request(
    model: str,
    images: Sequence[bytes],
    outputs: Sequence[str] = ("embedding",),
    *,
    parameters: dict[str, Parameter] | None = None,
    request_id: str = "",
) -> pb.ModelInferRequest:
    """A ModelInferRequest carrying encoded images (one a row) as the BYTES input `image` in raw form."""
    return _bytes_request(model, {IMAGE_INPUT: images}, outputs, parameters, request_id)


def _bytes_request(
    model: str,
    inputs: dict[str, Sequence[bytes]],
    outputs: Sequence[str],
    parameters: dict[str, Parameter] | None,
    request_id: str,
) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, id=request_id)
    for name, items in inputs.items():
        request.inputs.add(name=name, datatype="BYTES", shape=[len(items)])
        request.raw_input_contents.append(b"".join(_LENGTH.pack(len(item)) + item for item in items))
    for name in outputs:
        request.outputs.add(name=name)
    for key, value in (parameters or {}).items():
        # bool first: a bool is an int too.
        if isinstance(value, bool):
            request.parameters[key].bool_param = value
        elif isinstance(value, int):
            request.parameters[key].int64_param = value
        else:
            request.parameters[key].string_param = value
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
    values = output_values(response, name)
    if values.dtype != _DTYPES["FP32"]:
        raise EmbeddingError(grpc.StatusCode.INTERNAL, f"output {name} is {values.dtype}, expected FP32")
    return values


def output_values(response: pb.ModelInferResponse, name: str) -> np.ndarray:
    """One output of a response (FP32, INT8, UINT8 or INT64) as a numpy array of its shape."""
    for index, output in enumerate(response.outputs):
        if output.name == name:
            dtype = _DTYPES.get(output.datatype)
            if dtype is None:
                raise EmbeddingError(grpc.StatusCode.INTERNAL, f"output {name} has datatype {output.datatype}")
            return np.frombuffer(response.raw_output_contents[index], dtype=dtype).reshape(list(output.shape))
    raise EmbeddingError(grpc.StatusCode.INTERNAL, f"response has no output {name!r}")


def batches(texts: Sequence[str], batch_size: int) -> list[Sequence[str]]:
    """Texts in request-sized slices."""
    return [texts[start : start + batch_size] for start in range(0, len(texts), batch_size)]


def prompt_tokens(response: pb.ModelInferResponse) -> int:
    """The tokens the server counted for the request (its `prompt_tokens` response parameter; 0 if absent)."""
    counted = response.parameters.get("prompt_tokens")
    return counted.int64_param if counted is not None else 0
