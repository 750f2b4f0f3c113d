"""Malformed and nonsensical messages for the stress suite's fuzz phase (seeded, no extra dependencies).

Three kinds: bytes that are not a valid protobuf message at all; valid protobuf that is not a
sensible ModelInferRequest (unknown datatypes, huge or negative dimensions, contents of the wrong
size, raw and typed contents mixed, parameters of every kind, unknown inputs and outputs); and
valid requests damaged by a few flipped bytes (which may or may not still parse).
"""

from __future__ import annotations

import random
import struct

from client.protocol import text_request
from protocol import grpc_service_pb2 as pb

DATATYPES = ("BYTES", "INT64", "INT32", "FP32", "FP16", "BOOL", "UINT8", "", "NONSENSE", "int64")
INPUT_NAMES = ("text", "input_ids", "attention_mask", "token_type_ids", "", "unknown", "text\x00")
OUTPUT_NAMES = ("embedding", "last_hidden_state", "", "logits")
DIMENSIONS = (0, 1, 2, 3, 7, -1, -5, 2**31, 2**62, 2**63 - 1, -(2**63))
PARAMETER_NAMES = ("timeout", "priority", "sequence_id", "binary_data_output", "x")
CONTENT_FIELDS = tuple(field.name for field in pb.InferTensorContents.DESCRIPTOR.fields)
_INT64_RANGE = (-(2**63), 2**63 - 1)


def garbage_bytes(rng: random.Random) -> bytes:
    """Bytes that do not parse as a ModelInferRequest (a corrupt tag or a length that overruns)."""
    choice = rng.randrange(3)
    if choice == 0:
        # Field 5 (inputs), length-delimited, claiming far more bytes than follow.
        return b"\x2a" + b"\xff\xff\xff\xff\x07" + rng.randbytes(rng.randrange(0, 64))
    if choice == 1:
        # Wire type 7 does not exist.
        return bytes([(rng.randrange(1, 16) << 3) | 7]) + rng.randbytes(rng.randrange(0, 256))
    # A valid request cut off in the middle of its raw contents.
    message = text_request("model", ["some text to be cut short"] * 4).SerializeToString()
    return message[: len(message) - rng.randrange(1, 20)]


def flipped_bytes(rng: random.Random, model: str) -> bytes:
    """A valid text request with a few random bytes replaced."""
    message = bytearray(text_request(model, ["a short sentence", "another one"]).SerializeToString())
    for _ in range(rng.randrange(1, 4)):
        message[rng.randrange(len(message))] = rng.randrange(256)
    return bytes(message)


def _random_contents(rng: random.Random, contents: pb.InferTensorContents) -> None:
    for name in rng.sample(CONTENT_FIELDS, rng.randrange(0, 3)):
        field = getattr(contents, name)
        count = rng.randrange(0, 6)
        if name == "bool_contents":
            field.extend(rng.random() < 0.5 for _ in range(count))
        elif name in ("int_contents",):
            field.extend(rng.randrange(-(2**31), 2**31) for _ in range(count))
        elif name in ("uint_contents",):
            field.extend(rng.randrange(0, 2**32) for _ in range(count))
        elif name == "int64_contents":
            field.extend(rng.randint(*_INT64_RANGE) for _ in range(count))
        elif name == "uint64_contents":
            field.extend(rng.randrange(0, 2**64) for _ in range(count))
        elif name in ("fp32_contents", "fp64_contents"):
            field.extend(rng.choice((0.0, -1.5, 1e30, float("nan"), float("inf"))) for _ in range(count))
        else:
            field.extend(rng.choice((b"", b"text", b"\xff\xfe", rng.randbytes(8))) for _ in range(count))


def _random_parameter(rng: random.Random, parameter: pb.InferParameter) -> None:
    kind = rng.randrange(5)
    if kind == 0:
        parameter.bool_param = rng.random() < 0.5
    elif kind == 1:
        parameter.int64_param = rng.choice((-1, 0, 1, 1000, 2**62))
    elif kind == 2:
        parameter.string_param = rng.choice(("", "fast", "\u00e9"))
    elif kind == 3:
        parameter.double_param = rng.choice((0.5, -1.0, float("nan"), float("inf")))
    else:
        parameter.uint64_param = rng.choice((0, 1, 2**64 - 1))


def _raw_for(rng: random.Random, tensor: pb.ModelInferRequest.InferInputTensor) -> bytes:
    """Raw contents that fit the tensor's shape for INT64 or BYTES (sometimes), else random bytes."""
    elements = 1
    for dimension in tensor.shape:
        elements *= dimension
    if rng.random() < 0.5 and 0 <= elements <= 64:
        if tensor.datatype == "INT64":
            return struct.pack(f"<{elements}q", *(rng.randrange(-5, 40000) for _ in range(elements)))
        if tensor.datatype == "BYTES":
            return b"".join(struct.pack("<I", 4) + rng.randbytes(4) for _ in range(elements))
    return rng.randbytes(rng.randrange(0, 128))


def nonsense_request(rng: random.Random, model: str) -> pb.ModelInferRequest:
    """A ModelInferRequest that parses but makes little or no sense."""
    request = pb.ModelInferRequest(
        model_name=rng.choice((model, model, "", "no-such-model")),
        model_version=rng.choice(("", "1", "2", "-1", "latest")),
        id=rng.choice(("", "id", "\u2603" * 10)),
    )
    for name in rng.sample(PARAMETER_NAMES, rng.randrange(0, 3)):
        _random_parameter(rng, request.parameters[name])
    raw = rng.random() < 0.5
    for _ in range(rng.randrange(0, 4)):
        tensor = request.inputs.add(name=rng.choice(INPUT_NAMES), datatype=rng.choice(DATATYPES))
        tensor.shape.extend(rng.choice(DIMENSIONS) for _ in range(rng.randrange(0, 4)))
        if rng.random() < 0.3:
            _random_parameter(rng, tensor.parameters[rng.choice(PARAMETER_NAMES)])
        if not raw or rng.random() < 0.2:
            _random_contents(rng, tensor.contents)
        if raw:
            request.raw_input_contents.append(_raw_for(rng, tensor))
    if raw and rng.random() < 0.2:
        request.raw_input_contents.append(rng.randbytes(8))
    for _ in range(rng.randrange(0, 3)):
        output = request.outputs.add(name=rng.choice(OUTPUT_NAMES))
        if rng.random() < 0.3:
            _random_parameter(rng, output.parameters[rng.choice(PARAMETER_NAMES)])
    return request
