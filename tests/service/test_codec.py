"""Decoding ModelInferRequest (the wire) and validating it against a model (the engine), and encoding responses."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol import grpc_service_pb2 as pb
from service.core.repository import read_model
from service.errors import InvalidArgument
from service.frontends import codec
from service.pipeline.api import InferenceResult
from service.pipeline.requests import ModelSignature, ValidRequest
from service.pipeline.validation import validate
from tests.conftest import TINY_MODEL


def decode_infer_request(message: pb.ModelInferRequest, signature: ModelSignature) -> ValidRequest:
    """What a ModelInfer call becomes in the engine: the wire decoded, then checked against the model."""
    request = codec.decode_infer_request(message)
    return validate(request.inputs, request.outputs, request.parameters, signature)


@pytest.fixture(scope="module")
def signature(tiny_repository: Path) -> ModelSignature:
    spec = read_model(tiny_repository / TINY_MODEL)
    return ModelSignature(spec, accepts_text=True, max_batch_size=4)


def bytes_raw(elements: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


def text_request(texts: list[bytes], shape: list[int] | None = None) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=TINY_MODEL, id="r1")
    request.inputs.add(name="text", datatype="BYTES", shape=shape or [len(texts)])
    request.raw_input_contents.append(bytes_raw(texts))
    return request


def token_request(ids: np.ndarray, mask: np.ndarray | None = None, raw: bool = True) -> pb.ModelInferRequest:
    mask = np.ones_like(ids) if mask is None else mask
    request = pb.ModelInferRequest(model_name=TINY_MODEL)
    for name, array in (("input_ids", ids), ("attention_mask", mask)):
        tensor = request.inputs.add(name=name, datatype="INT64", shape=array.shape)
        if raw:
            request.raw_input_contents.append(array.astype("<i8").tobytes())
        else:
            tensor.contents.int64_contents.extend(array.ravel().tolist())
    return request


@given(st.lists(st.text(min_size=1).filter(str.strip), min_size=1, max_size=4))
def test_text_round_trips_through_raw_bytes(signature: ModelSignature, texts: list[str]) -> None:
    decoded = decode_infer_request(text_request([t.encode() for t in texts]), signature)
    assert decoded.texts == texts
    assert decoded.outputs == ("last_hidden_state", "embedding")


def test_token_inputs_raw_and_typed_agree(signature: ModelSignature) -> None:
    ids = np.array([[101, 2023, 102], [101, 102, 0]])
    mask = np.array([[1, 1, 1], [1, 1, 0]])
    raw = decode_infer_request(token_request(ids, mask), signature)
    typed = decode_infer_request(token_request(ids, mask, raw=False), signature)
    for decoded in (raw, typed):
        padded = decoded.tokens.padded()
        np.testing.assert_array_equal(padded["input_ids"], ids)
        np.testing.assert_array_equal(padded["attention_mask"], mask)
        assert decoded.tokens.lengths.tolist() == [3, 2]  # right padding dropped: each row at its own length


def test_text_shape_batch_by_one_is_accepted(signature: ModelSignature) -> None:
    assert decode_infer_request(text_request([b"a", b"b"], [2, 1]), signature).texts == ["a", "b"]


def test_timeout_parameter_and_requested_outputs(signature: ModelSignature) -> None:
    request = text_request([b"hello"])
    request.parameters["timeout"].int64_param = 250_000
    request.outputs.add(name="embedding")
    decoded = decode_infer_request(request, signature)
    assert decoded.timeout_s == 0.25
    assert decoded.outputs == ("embedding",)


def _with(request: pb.ModelInferRequest, change) -> pb.ModelInferRequest:
    change(request)
    return request


BAD_REQUESTS = {
    "no inputs": (lambda: pb.ModelInferRequest(model_name=TINY_MODEL), "no inputs"),
    "unknown input": (
        lambda: _with(text_request([b"x"]), lambda r: setattr(r.inputs[0], "name", "sentence")),
        "unknown input 'sentence'",
    ),
    "wrong datatype": (
        lambda: _with(text_request([b"x"]), lambda r: setattr(r.inputs[0], "datatype", "FP32")),
        "datatype FP32, expected BYTES",
    ),
    "shape vs contents": (lambda: text_request([b"a", b"b"], [3]), "raw contents hold 2 elements, shape needs 3"),
    "raw byte length": (
        lambda: _with(token_request(np.array([[1, 2]])), lambda r: r.raw_input_contents.__setitem__(0, b"\0" * 15)),
        "raw contents are 15 bytes, shape [1, 2] of INT64 needs 16",
    ),
    "truncated bytes": (
        lambda: _with(text_request([b"abc"]), lambda r: r.raw_input_contents.__setitem__(0, b"\x09\0\0\0abc")),
        "element 0 claims 9 bytes, 3 remain",
    ),
    "raw count": (
        lambda: _with(token_request(np.array([[1, 2]])), lambda r: r.raw_input_contents.pop()),
        "1 raw_input_contents for 2 inputs",
    ),
    "typed count": (
        lambda: _with(
            token_request(np.array([[1, 2]]), raw=False), lambda r: r.inputs[0].contents.int64_contents.append(5)
        ),
        "3 elements in int64_contents, shape [1, 2] needs 2",
    ),
    "wrong typed field": (
        lambda: _with(
            token_request(np.array([[1, 2]]), raw=False), lambda r: r.inputs[1].contents.fp32_contents.append(1.0)
        ),
        "carries fp32_contents",
    ),
    "out of vocabulary": (lambda: token_request(np.array([[101, 30522]])), "token id 30522 is outside the vocabulary"),
    "negative id": (lambda: token_request(np.array([[-1, 5]])), "token id -1 is outside"),
    "too long": (lambda: token_request(np.ones((1, 129), dtype=np.int64)), "sequence length 129 exceeds"),
    "batch too large": (lambda: text_request([b"a"] * 5), "batch of 5 exceeds the model's max_batch_size 4"),
    "empty text": (lambda: text_request([b"fine", b"  "]), "text[1] is empty"),
    "bad utf-8": (lambda: text_request([b"\xff\xfe"]), "text[0] is not valid UTF-8"),
    "missing mask": (
        lambda: _with(token_request(np.array([[1, 2]])), lambda r: (r.inputs.pop(), r.raw_input_contents.pop())),
        "missing input attention_mask",
    ),
    "mixed inputs": (
        lambda: _with(
            text_request([b"a"]),
            lambda r: (
                r.inputs.add(name="input_ids", datatype="INT64", shape=[1, 1]),
                r.raw_input_contents.append(b"\1" + b"\0" * 7),
            ),
        ),
        "text cannot be combined",
    ),
    "mask values": (lambda: token_request(np.array([[1, 2]]), np.array([[1, 2]])), "values must be 0 or 1"),
    "empty row": (lambda: token_request(np.array([[1, 2]]), np.array([[0, 0]])), "row 0 attends to no token"),
    "unknown output": (
        lambda: _with(text_request([b"x"]), lambda r: r.outputs.add(name="logits")),
        "unknown output 'logits'",
    ),
    "bad timeout": (
        lambda: _with(text_request([b"x"]), lambda r: setattr(r.parameters["timeout"], "string_param", "soon")),
        "timeout must be a non-negative integer",
    ),
    "duplicate input": (
        lambda: _with(
            text_request([b"x"]),
            lambda r: (
                r.inputs.add(name="text", datatype="BYTES", shape=[1]),
                r.raw_input_contents.append(bytes_raw([b"y"])),
            ),
        ),
        "given twice",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_requests_name_what_is_wrong(signature: ModelSignature, case: str) -> None:
    build, message = BAD_REQUESTS[case]
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        decode_infer_request(build(), signature)


def test_response_carries_requested_outputs_in_order_as_raw(signature: ModelSignature) -> None:
    request = text_request([b"x", b"y"])
    request.outputs.add(name="embedding")
    request.outputs.add(name="last_hidden_state")
    decoded = decode_infer_request(request, signature)
    assert decoded.outputs == ("embedding", "last_hidden_state")
    embedding = np.arange(64, dtype=np.float32).reshape(2, 32)
    hidden = np.ones((2, 3, 32), dtype=np.float32)
    outputs = {"embedding": embedding, "last_hidden_state": hidden}
    response = codec.encode_infer_response(InferenceResult(TINY_MODEL, "1", "r1", outputs, 4))
    assert response.id == "r1" and response.model_version == "1"
    assert [(o.name, list(o.shape), o.datatype) for o in response.outputs] == [
        ("embedding", [2, 32], "FP32"),
        ("last_hidden_state", [2, 3, 32], "FP32"),
    ]
    np.testing.assert_array_equal(np.frombuffer(response.raw_output_contents[0], "<f4").reshape(2, 32), embedding)
