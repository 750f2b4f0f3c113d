"""KServe v2 REST as Triton serves it and tritonclient.http speaks it.

An infer body is JSON, or JSON followed by binary tensor data whose JSON length the header
`Inference-Header-Content-Length` gives (Triton's binary-tensor extension). It is turned into the
engine's request (binary data as raw contents, JSON data as typed values), which the engine checks
as it checks the gRPC port's. In JSON, an `image` input's elements are base64 strings (or data: URIs):
images are not UTF-8 text; binary data carries them as they are. Metadata, configuration and statistics
are the gRPC port's messages, written in JSON as Triton writes them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from service.errors import InvalidArgument
from service.frontends.codec import output_array
from service.frontends.http.image_data import image_bytes
from service.pipeline.api import (
    DEFAULT_NAMES,
    IMAGE_INPUT,
    JSON,
    RAW,
    InferenceRequest,
    InferenceResult,
    InputTensor,
    json_values,
)

HEADER_LENGTH = "inference-header-content-length"
BINARY_OUTPUT = "binary_data_output"
_REQUEST_FIELDS = ("id", "parameters", "inputs", "outputs")
_INPUT_FIELDS = ("name", "shape", "datatype", "parameters", "data")
_OUTPUT_FIELDS = ("name", "parameters")
_INT64_RANGE = (-(2**63), 2**63 - 1)
_INT64_TYPES = frozenset(
    (
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED64,
    )
)


@dataclass(frozen=True)
class RestInferRequest:
    """A v2 REST infer body as the engine's request, and how each output is to be returned."""

    request: InferenceRequest
    binary_outputs: dict[str, bool]
    """Outputs that asked for (or against) binary data by name; the others follow `binary_by_default`."""
    binary_by_default: bool


def _fields(where: str, value: object, allowed: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidArgument(f"{where} must be a JSON object")
    unknown = [name for name in value if name not in allowed]
    if unknown:
        raise InvalidArgument(f"{where}: unknown field {unknown[0]!r} (fields: {', '.join(allowed)})")
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parameter(name: str, value: object) -> bool | int | float | str:
    """One JSON parameter, checked to be what a KServe InferParameter can hold."""
    if isinstance(value, (bool, str)):
        return value
    if _is_int(value) and _INT64_RANGE[0] <= value <= _INT64_RANGE[1]:
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    raise InvalidArgument(f"parameter {name!r} must be a boolean, a 64-bit integer, a number or a string")


def _flatten(data: list[object]) -> Iterator[object]:
    """The elements of (possibly nested) JSON arrays, row-major, without recursion."""
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            yield item
        else:
            stack.pop()


def _json_data(name: str, datatype: str, data: object, count: int) -> list:
    """JSON `data` as typed values: BYTES as UTF-8 bytes (images: base64), INT64 as integers, others as they are.

    The engine refuses a datatype the model does not take, naming the one it expects.
    """
    if not isinstance(data, list):
        raise InvalidArgument(f"input {name}: data must be a JSON array")
    elements = list(_flatten(data))
    if len(elements) != count:
        raise InvalidArgument(f"input {name}: data holds {len(elements)} elements, its shape needs {count}")
    if datatype == "BYTES":
        if not all(isinstance(item, str) for item in elements):
            raise InvalidArgument(f"input {name}: BYTES data must be strings")
        if name == IMAGE_INPUT:
            return [image_bytes(item, f"input {name}[{index}]") for index, item in enumerate(elements)]
        return [item.encode("utf-8", "surrogatepass") for item in elements]
    if datatype == "INT64" and not all(
        _is_int(item) and _INT64_RANGE[0] <= item <= _INT64_RANGE[1] for item in elements
    ):
        raise InvalidArgument(f"input {name}: INT64 data must be 64-bit integers")
    return elements


def _input(tensor: object, index: int, binary: memoryview, offset: int) -> tuple[InputTensor, int]:
    """One input (binary data as raw contents, JSON data as values), and the binary offset after it."""
    fields = _fields(f"inputs[{index}]", tensor, _INPUT_FIELDS)
    name, datatype, shape = fields.get("name"), fields.get("datatype"), fields.get("shape")
    if not isinstance(name, str) or not isinstance(datatype, str):
        raise InvalidArgument(f"inputs[{index}]: name and datatype must be strings")
    if not isinstance(shape, list) or not all(_is_int(d) and 0 <= d <= _INT64_RANGE[1] for d in shape):
        raise InvalidArgument(f"input {name}: shape must be a list of non-negative integers")
    parameters = _fields(f"input {name} parameters", fields.get("parameters", {}), ("binary_data_size",))
    if "binary_data_size" in parameters:
        size = parameters["binary_data_size"]
        if "data" in fields:
            raise InvalidArgument(f"input {name}: has both data and binary_data_size")
        if not _is_int(size) or size < 0 or offset + size > len(binary):
            raise InvalidArgument(
                f"input {name}: binary_data_size {size!r} does not fit the {len(binary) - offset} bytes of binary"
                " data left"
            )
        return InputTensor(name, datatype, tuple(shape), bytes(binary[offset : offset + size]), raw=True), offset + size
    if "data" not in fields:
        raise InvalidArgument(f"input {name}: needs data, or binary_data_size with binary data after the JSON")
    data = _json_data(name, datatype, fields["data"], math.prod(shape))
    return InputTensor(name, datatype, tuple(shape), data, raw=False), offset


def _outputs(value: object) -> tuple[tuple[str, ...], dict[str, bool]]:
    """The requested output names, and those that asked for (or against) binary data."""
    if not isinstance(value, list):
        raise InvalidArgument("outputs must be a list")
    names: list[str] = []
    binary: dict[str, bool] = {}
    for index, output in enumerate(value):
        fields = _fields(f"outputs[{index}]", output, _OUTPUT_FIELDS)
        name = fields.get("name")
        if not isinstance(name, str):
            raise InvalidArgument(f"outputs[{index}]: name must be a string")
        parameters = _fields(f"output {name} parameters", fields.get("parameters", {}), ("binary_data",))
        if "binary_data" in parameters:
            if not isinstance(parameters["binary_data"], bool):
                raise InvalidArgument(f"output {name}: binary_data must be true or false")
            binary[name] = parameters["binary_data"]
        names.append(name)
    return tuple(names), binary


def split_body(body: bytes, header_length: str | None) -> tuple[bytes, memoryview]:
    """The JSON part of an infer body and the binary data after it."""
    if header_length is None:
        return body, memoryview(b"")
    if not header_length.isdigit() or int(header_length) > len(body):
        raise InvalidArgument(
            f"Inference-Header-Content-Length {header_length!r} must be a byte count within the body's {len(body)}"
        )
    split = int(header_length)
    return body[:split], memoryview(body)[split:]


def parse_repository_index(payload: object) -> bool:
    """A POST /v2/repository/index body: whether to list only ready models (`{"ready": true}`)."""
    fields = _fields("the repository index request", payload, ("repository_name", "ready"))
    ready = fields.get("ready", False)
    if not isinstance(ready, bool):
        raise InvalidArgument("the repository index request: 'ready' must be true or false")
    return ready


def parse_infer(payload: object, binary: memoryview, name: str, version: str) -> RestInferRequest:
    """A v2 REST infer body (its JSON, and the binary data after it) as the engine's request."""
    fields = _fields("the request", payload, _REQUEST_FIELDS)
    request_id = fields.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidArgument("id must be a string")
    parameters = fields.get("parameters", {})
    if not isinstance(parameters, dict):
        raise InvalidArgument("parameters must be a JSON object")
    binary_by_default = parameters.get(BINARY_OUTPUT, False)
    if not isinstance(binary_by_default, bool):
        raise InvalidArgument(f"parameter {BINARY_OUTPUT} must be true or false")
    values = {key: _parameter(key, value) for key, value in parameters.items() if key != BINARY_OUTPUT}
    tensors = fields.get("inputs")
    if not isinstance(tensors, list) or not tensors:
        raise InvalidArgument("inputs must be a non-empty list")
    inputs, offset = [], 0
    for index, tensor in enumerate(tensors):
        parsed, offset = _input(tensor, index, binary, offset)
        inputs.append(parsed)
    if offset != len(binary):
        raise InvalidArgument(f"{len(binary) - offset} bytes of binary data follow the inputs' binary_data_size")
    outputs, binary_outputs = _outputs(fields["outputs"]) if "outputs" in fields else ((), {})
    encodings = {
        output: RAW if binary_outputs.get(output, binary_by_default) else JSON for output in outputs or DEFAULT_NAMES
    }
    request = InferenceRequest(
        model=name,
        version=version,
        id=request_id,
        inputs=tuple(inputs),
        outputs=outputs,
        parameters=values,
        encodings=encodings,
    )
    return RestInferRequest(request, binary_outputs, binary_by_default)


def encode_outputs(rest: RestInferRequest, result: InferenceResult) -> tuple[bytes, int | None]:
    """The response body, and the JSON part's length when binary data follows it."""
    tensors, chunks = [], []
    for name, output in result.outputs.items():
        array, datatype = output_array(output)
        tensor: dict[str, object] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        if rest.binary_outputs.get(name, rest.binary_by_default):
            tensor["parameters"] = {"binary_data_size": array.nbytes}
            chunks.append(array.tobytes())
        else:
            tensor["data"] = json_values(array)
        tensors.append(tensor)
    answer: dict[str, object] = {"model_name": result.model, "model_version": result.version}
    if result.id:
        answer["id"] = result.id
    answer["outputs"] = tensors
    header = orjson.dumps(answer)
    if not chunks:
        return header, None
    return b"".join([header, *chunks]), len(header)


def proto_json(message: Message, every_field: bool = False) -> dict[str, object]:
    """A protobuf message as Triton writes it in JSON: proto field names, enum names, 64-bit integers as numbers.

    `every_field` writes fields at their defaults too (zero counts, empty lists), as Triton's statistics do.
    """
    if every_field:
        fields = [(field, getattr(message, field.name)) for field in message.DESCRIPTOR.fields]
    else:
        fields = message.ListFields()
    return {field.name: _json_field(field, value, every_field) for field, value in fields}


def _json_field(field: FieldDescriptor, value: Any, every_field: bool) -> object:
    entry = field.message_type
    if entry is not None and entry.GetOptions().map_entry:
        value_field = entry.fields_by_name["value"]
        return {key: _json_scalar(value_field, item, every_field) for key, item in value.items()}
    if field.is_repeated:
        return [_json_scalar(field, item, every_field) for item in value]
    return _json_scalar(field, value, every_field)


def _json_scalar(field: FieldDescriptor, value: Any, every_field: bool) -> object:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return proto_json(value, every_field)
    if field.type == FieldDescriptor.TYPE_ENUM:
        return field.enum_type.values_by_number[value].name
    if field.type in _INT64_TYPES:
        return int(value)
    return value
