"""Protobuf <-> numpy for the KServe v2 protocol, and all validation of what a request carries."""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass

import numpy as np

from service.errors import InvalidArgument
from service.proto import grpc_service_pb2 as pb
from service.proto import model_config_pb2 as mc
from service.repository import OUTPUTS, PLATFORM, ModelSpec

TEXT_INPUT = "text"
REQUIRED_TOKEN_INPUTS = ("input_ids", "attention_mask")
"""Token inputs a token request must carry; token_type_ids defaults to zeros."""
_LENGTH_PREFIX = struct.Struct("<I")
_INT64 = np.dtype("<i8")
_FP32 = np.dtype("<f4")
_CONTENT_FIELDS = {"INT64": "int64_contents", "BYTES": "bytes_contents"}
_ALL_CONTENT_FIELDS = tuple(field.name for field in pb.InferTensorContents.DESCRIPTOR.fields)


@dataclass(frozen=True)
class InferenceRequest:
    """A validated request: either texts or token arrays (all int64 [rows, length])."""

    id: str
    texts: list[str] | None
    tokens: dict[str, np.ndarray] | None
    outputs: tuple[str, ...]
    """Requested outputs, in the order they are to be returned."""
    timeout_s: float | None
    """Triton's per-request `timeout` parameter, when given."""

    @property
    def rows(self) -> int:
        """Sequences in the request."""
        return len(self.texts) if self.texts is not None else self.tokens["input_ids"].shape[0]


@dataclass(frozen=True)
class TextLimits:
    """Bounds on the text one request may carry, checked before any tokenisation."""

    max_text_bytes: int = 64 * 1024
    """One text, UTF-8 bytes (--max-text-bytes)."""
    max_request_text_bytes: int = 1024 * 1024
    """All texts of a request together, UTF-8 bytes (--max-request-text-bytes)."""


@dataclass(frozen=True)
class ModelSignature:
    """What a model accepts, as the codec checks it."""

    spec: ModelSpec
    accepts_text: bool
    max_batch_size: int
    text_limits: TextLimits = TextLimits()

    @functools.cached_property
    def input_datatypes(self) -> dict[str, str]:
        """Accepted input name -> KServe datatype (built once: every request is checked against it)."""
        names = {name: "INT64" for name in self.spec.input_names}
        if self.accepts_text:
            names[TEXT_INPUT] = "BYTES"
        return names


def _shape_text(shape: list[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _split_bytes(name: str, raw: bytes, count: int) -> list[bytes]:
    """BYTES raw contents: each element a 4-byte little-endian length then the bytes."""
    view = memoryview(raw)
    elements: list[bytes] = []
    offset = 0
    while offset < len(view):
        if offset + 4 > len(view):
            raise InvalidArgument(f"input {name}: truncated length prefix at byte {offset} of raw contents")
        (size,) = _LENGTH_PREFIX.unpack_from(view, offset)
        offset += 4
        if offset + size > len(view):
            raise InvalidArgument(
                f"input {name}: element {len(elements)} claims {size} bytes, {len(view) - offset} remain"
            )
        elements.append(bytes(view[offset : offset + size]))
        offset += size
    if len(elements) != count:
        raise InvalidArgument(f"input {name}: raw contents hold {len(elements)} elements, shape needs {count}")
    return elements


def _check_only_field(name: str, contents: pb.InferTensorContents, wanted: str) -> None:
    for other in _ALL_CONTENT_FIELDS:
        if other != wanted and len(getattr(contents, other)):
            raise InvalidArgument(f"input {name}: carries {other}; its datatype's data goes in {wanted}")


def _tensor_data(
    tensor: pb.ModelInferRequest.InferInputTensor, raw: bytes | None, datatype: str
) -> np.ndarray | list[bytes]:
    """The tensor's elements, from raw or typed contents, checked against its shape."""
    shape = list(tensor.shape)
    count = math.prod(shape)
    if raw is not None:
        if datatype == "BYTES":
            return _split_bytes(tensor.name, raw, count)
        if len(raw) != count * _INT64.itemsize:
            raise InvalidArgument(
                f"input {tensor.name}: raw contents are {len(raw)} bytes, shape {_shape_text(shape)} of "
                f"{datatype} needs {count * _INT64.itemsize}"
            )
        return np.frombuffer(raw, dtype=_INT64).reshape(shape)
    wanted = _CONTENT_FIELDS[datatype]
    _check_only_field(tensor.name, tensor.contents, wanted)
    values = getattr(tensor.contents, wanted)
    if len(values) != count:
        raise InvalidArgument(
            f"input {tensor.name}: {len(values)} elements in {wanted}, shape {_shape_text(shape)} needs {count}"
        )
    if datatype == "BYTES":
        return list(values)
    return np.array(values, dtype=np.int64).reshape(shape)


def _check_text_sizes(elements: list[bytes], limits: TextLimits) -> None:
    total = 0
    for index, element in enumerate(elements):
        if len(element) > limits.max_text_bytes:
            raise InvalidArgument(
                f"input text[{index}] is {len(element)} bytes, over the limit of {limits.max_text_bytes} bytes per"
                " text (--max-text-bytes)",
                "text_too_large",
            )
        total += len(element)
    if total > limits.max_request_text_bytes:
        raise InvalidArgument(
            f"the texts of this request total {total} bytes, over the limit of {limits.max_request_text_bytes} bytes"
            " per request (--max-request-text-bytes)",
            "request_text_too_large",
        )


def _decode_texts(elements: list[bytes]) -> list[str]:
    texts = []
    for index, element in enumerate(elements):
        try:
            text = element.decode("utf-8")
        except UnicodeDecodeError as error:
            raise InvalidArgument(
                f"input text[{index}] is not valid UTF-8 ({error.reason} at byte {error.start})"
            ) from error
        if not text.strip():
            raise InvalidArgument(f"input text[{index}] is empty")
        texts.append(text)
    return texts


def text_request(elements: list[bytes], signature: ModelSignature, outputs: tuple[str, ...]) -> InferenceRequest:
    """A request of texts (UTF-8 bytes) from another front end, checked as ModelInfer's: sizes, encoding, emptiness.

    The caller bounds how many texts one request may carry; the engine runs them in batches.
    """
    if not elements:
        raise InvalidArgument("the batch is empty")
    _check_text_sizes(elements, signature.text_limits)
    return InferenceRequest(id="", texts=_decode_texts(elements), tokens=None, outputs=outputs, timeout_s=None)


def _check_tokens(tokens: dict[str, np.ndarray], signature: ModelSignature) -> None:
    spec = signature.spec
    missing = [n for n in REQUIRED_TOKEN_INPUTS if n not in tokens]
    if missing:
        raise InvalidArgument(f"missing input {missing[0]} (token inputs are input_ids and attention_mask)")
    shape = tokens["input_ids"].shape
    for name, array in tokens.items():
        if array.ndim != 2:
            raise InvalidArgument(f"input {name}: shape {_shape_text(list(array.shape))} must be [batch, sequence]")
        if array.shape != shape:
            given, expected = _shape_text(list(array.shape)), _shape_text(list(shape))
            raise InvalidArgument(f"input {name}: shape {given} differs from input_ids {expected}")
    length = shape[1]
    if length < 1:
        raise InvalidArgument("token inputs must hold at least one token per sequence")
    if length > spec.max_sequence_length:
        raise InvalidArgument(f"sequence length {length} exceeds the model's maximum {spec.max_sequence_length}")
    ids = tokens["input_ids"]
    if ids.size and (ids.min() < 0 or ids.max() >= spec.vocab_size):
        bad = ids[(ids < 0) | (ids >= spec.vocab_size)][0]
        raise InvalidArgument(f"input_ids: token id {bad} is outside the vocabulary [0, {spec.vocab_size})")
    mask = tokens["attention_mask"]
    if ((mask != 0) & (mask != 1)).any():
        raise InvalidArgument("attention_mask: values must be 0 or 1")
    empty_rows = np.flatnonzero(mask.sum(axis=1) == 0)
    if empty_rows.size:
        raise InvalidArgument(f"attention_mask: row {empty_rows[0]} attends to no token")
    types = tokens.get("token_type_ids")
    if types is not None and types.size and (types.min() < 0 or types.max() >= signature.spec.type_vocab_size):
        raise InvalidArgument(f"token_type_ids: values must be in [0, {signature.spec.type_vocab_size})")


def _requested_outputs(request: pb.ModelInferRequest) -> tuple[str, ...]:
    if not request.outputs:
        return OUTPUTS
    names = tuple(output.name for output in request.outputs)
    for name in names:
        if name not in OUTPUTS:
            raise InvalidArgument(f"unknown output {name!r} (outputs: {', '.join(OUTPUTS)})")
    if len(set(names)) != len(names):
        raise InvalidArgument("an output is requested twice")
    return names


def _timeout_s(request: pb.ModelInferRequest) -> float | None:
    if "timeout" not in request.parameters:
        return None
    parameter = request.parameters["timeout"]
    choice = parameter.WhichOneof("parameter_choice")
    if choice not in ("int64_param", "uint64_param") or getattr(parameter, choice) < 0:
        raise InvalidArgument("parameter timeout must be a non-negative integer (microseconds)")
    value = getattr(parameter, choice)
    return value / 1e6 if value else None


def _decode_inputs(request: pb.ModelInferRequest, accepted: dict[str, str]) -> dict[str, np.ndarray | list[bytes]]:
    """Each input's elements by name, checked for name, datatype, shape and content size."""
    if not request.inputs:
        raise InvalidArgument(f"no inputs; the model takes {', '.join(accepted)}")
    raw_contents = request.raw_input_contents
    if raw_contents:
        if len(raw_contents) != len(request.inputs):
            raise InvalidArgument(
                f"{len(raw_contents)} raw_input_contents for {len(request.inputs)} inputs; they must pair up"
            )
        carrying = [t.name for t in request.inputs if t.HasField("contents")]
        if carrying:
            raise InvalidArgument(f"input {carrying[0]} has contents although raw_input_contents are used")
    decoded: dict[str, np.ndarray | list[bytes]] = {}
    for index, tensor in enumerate(request.inputs):
        if tensor.name not in accepted:
            raise InvalidArgument(f"unknown input {tensor.name!r} (inputs: {', '.join(accepted)})")
        if tensor.name in decoded:
            raise InvalidArgument(f"input {tensor.name} given twice")
        if tensor.datatype != accepted[tensor.name]:
            raise InvalidArgument(
                f"input {tensor.name}: datatype {tensor.datatype or '(none)'}, expected {accepted[tensor.name]}"
            )
        if any(d < 0 for d in tensor.shape) or not tensor.shape:
            raise InvalidArgument(f"input {tensor.name}: shape {_shape_text(list(tensor.shape))} is not a valid shape")
        raw = raw_contents[index] if raw_contents else None
        decoded[tensor.name] = _tensor_data(tensor, raw, accepted[tensor.name])
    return decoded


def _text_shape_check(shape: list[int]) -> None:
    if len(shape) not in (1, 2) or (len(shape) == 2 and shape[1] != 1):
        raise InvalidArgument(f"input text: shape {_shape_text(shape)} must be [batch] or [batch, 1]")


def decode_infer_request(request: pb.ModelInferRequest, signature: ModelSignature) -> InferenceRequest:
    """Validate a ModelInferRequest against a model and turn it into arrays (no copies of raw data)."""
    decoded = _decode_inputs(request, signature.input_datatypes)
    texts = None
    tokens = None
    if TEXT_INPUT in decoded:
        if len(decoded) > 1:
            raise InvalidArgument("input text cannot be combined with token inputs")
        _text_shape_check(list(request.inputs[0].shape))
        _check_text_sizes(decoded[TEXT_INPUT], signature.text_limits)
        texts = _decode_texts(decoded[TEXT_INPUT])
        rows = len(texts)
    else:
        tokens = {name: np.asarray(value) for name, value in decoded.items()}
        _check_tokens(tokens, signature)
        rows = tokens["input_ids"].shape[0]
    if rows < 1:
        raise InvalidArgument("the batch is empty")
    if rows > signature.max_batch_size:
        raise InvalidArgument(f"batch of {rows} exceeds the model's max_batch_size {signature.max_batch_size}")
    return InferenceRequest(
        id=request.id,
        texts=texts,
        tokens=tokens,
        outputs=_requested_outputs(request),
        timeout_s=_timeout_s(request),
    )


def encode_infer_response(
    request: InferenceRequest, outputs: dict[str, np.ndarray], spec: ModelSpec
) -> pb.ModelInferResponse:
    """Outputs as raw_output_contents, in the requested order; the request id echoed."""
    response = pb.ModelInferResponse(model_name=spec.name, model_version=spec.version, id=request.id)
    for name in request.outputs:
        array = np.ascontiguousarray(outputs[name], dtype=_FP32)
        response.outputs.add(name=name, datatype="FP32", shape=array.shape)
        response.raw_output_contents.append(array.tobytes())
    return response


_METADATA_DATATYPES = {mc.TYPE_STRING: "BYTES", mc.TYPE_INT64: "INT64", mc.TYPE_FP32: "FP32"}


def served_inputs(signature: ModelSignature) -> list[mc.ModelInput]:
    """The inputs as served, in Triton's terms; ModelConfig and ModelMetadata both list these.

    `text` (TYPE_STRING, one string per row) comes first when the server tokenises for the model.
    It is not an input of the ONNX graph, so config.pbtxt cannot hold it (Triton would refuse the
    file): the server adds it here. A request sends either the text or the token inputs, so every
    input is `optional` when text is accepted; otherwise only token_type_ids is.
    """
    inputs = []
    if signature.accepts_text:
        inputs.append(mc.ModelInput(name=TEXT_INPUT, data_type=mc.TYPE_STRING, dims=[1], optional=True))
    for tensor in signature.spec.config.input:
        served = mc.ModelInput()
        served.CopyFrom(tensor)
        served.optional = signature.accepts_text or tensor.name not in REQUIRED_TOKEN_INPUTS
        inputs.append(served)
    return inputs


def model_metadata(signature: ModelSignature) -> pb.ModelMetadataResponse:
    """The served inputs and the model's outputs, shapes with the batch dimension first (-1: variable)."""
    spec = signature.spec
    response = pb.ModelMetadataResponse(name=spec.name, versions=[spec.version], platform=PLATFORM)
    for tensor in served_inputs(signature):
        response.inputs.add(name=tensor.name, datatype=_METADATA_DATATYPES[tensor.data_type], shape=[-1, *tensor.dims])
    for tensor in spec.config.output:
        response.outputs.add(name=tensor.name, datatype=_METADATA_DATATYPES[tensor.data_type], shape=[-1, *tensor.dims])
    return response
