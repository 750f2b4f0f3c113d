"""Protobuf <-> the engine's plain types, for the KServe v2 / Triton gRPC protocol.

Decoding checks only what belongs to the wire format (raw contents pair up with inputs; typed data
sits in its datatype's field); everything about the model is checked by the engine
(service.pipeline.validation), for every protocol alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import metadata

import numpy as np

from protocol import grpc_service_pb2 as pb
from protocol import model_config_pb2 as mc
from service.core.repository import PLATFORM
from service.errors import InvalidArgument, Unimplemented
from service.ops.statistics import Duration, ModelStatistics
from service.pipeline.api import (
    IMAGE_INPUT,
    MULTIVECTOR,
    QUERY_INPUT,
    REQUIRED_TOKEN_INPUTS,
    TEXT_INPUT,
    TOKENS,
    InferenceRequest,
    InferenceResult,
    InputTensor,
    ModelInfo,
    ModelSignature,
    ModelState,
    output_width,
)

SERVER_NAME = "encoder-serve"
EXTENSIONS = ("model_configuration", "parameters", "statistics")
_LOADED_AT_START = "models are loaded at start from --model-repository"
_IN_MESSAGES = "tensors travel inside the messages"
UNSUPPORTED = {
    "RepositoryModelLoad": _LOADED_AT_START,
    "RepositoryModelUnload": _LOADED_AT_START,
    **{
        f"{memory}SharedMemory{action}": _IN_MESSAGES
        for memory in ("System", "Cuda")
        for action in ("Status", "Register", "Unregister")
    },
    "TraceSetting": "use the Prometheus metrics and --log-level DEBUG timings",
    "LogSettings": "logging is set at start with --log-level",
}
"""Methods of Triton's service this server declares and does not offer, and why (both ports answer with it)."""
_FP32 = np.dtype("<f4")
CONTENT_FIELDS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
"""The InferTensorContents field that carries each datatype's typed data."""
_ALL_CONTENT_FIELDS = tuple(field.name for field in pb.InferTensorContents.DESCRIPTOR.fields)


def server_metadata() -> pb.ServerMetadataResponse:
    """The server's name, version and protocol extensions."""
    try:
        version = metadata.version(SERVER_NAME)
    except metadata.PackageNotFoundError:
        version = "unknown"
    return pb.ServerMetadataResponse(name=SERVER_NAME, version=version, extensions=EXTENSIONS)


def unsupported(method: str) -> Unimplemented:
    """The refusal of a method this server declares and does not offer, naming why."""
    return Unimplemented(f"{method} is not supported by this server: {UNSUPPORTED[method]}")


def repository_index(states: Sequence[ModelState]) -> pb.RepositoryIndexResponse:
    """The repository's models with their states."""
    response = pb.RepositoryIndexResponse()
    for state in states:
        response.models.add(name=state.name, version=state.version, state=state.state, reason=state.reason)
    return response


def _parameters(parameters: object) -> dict[str, bool | int | float | str]:
    """A protobuf InferParameter map as plain values."""
    values = {}
    for name, parameter in parameters.items():
        choice = parameter.WhichOneof("parameter_choice")
        if choice is not None:
            values[name] = getattr(parameter, choice)
    return values


def _typed_data(tensor: pb.ModelInferRequest.InferInputTensor) -> list:
    """The values of a tensor sent as typed contents: from its datatype's field, which must be the only one used."""
    wanted = CONTENT_FIELDS.get(tensor.datatype)
    for other in _ALL_CONTENT_FIELDS:
        if other != wanted and len(getattr(tensor.contents, other)):
            raise InvalidArgument(f"input {tensor.name}: carries {other}; its datatype's data goes in {wanted}")
    return list(getattr(tensor.contents, wanted)) if wanted is not None else []


def decode_infer_request(request: pb.ModelInferRequest) -> InferenceRequest:
    """A ModelInferRequest as the engine's request (raw data is not copied)."""
    tensors = request.inputs
    raw_contents = request.raw_input_contents
    inputs = []
    if raw_contents:
        if len(raw_contents) != len(tensors):
            raise InvalidArgument(
                f"{len(raw_contents)} raw_input_contents for {len(tensors)} inputs; they must pair up"
            )
        for tensor, raw in zip(tensors, raw_contents, strict=True):
            if tensor.HasField("contents"):
                raise InvalidArgument(f"input {tensor.name} has contents although raw_input_contents are used")
            inputs.append(InputTensor(tensor.name, tensor.datatype, tuple(tensor.shape), raw, True))
    else:
        for tensor in tensors:
            inputs.append(InputTensor(tensor.name, tensor.datatype, tuple(tensor.shape), _typed_data(tensor), False))
    outputs = request.outputs
    return InferenceRequest(
        request.model_name,
        request.model_version,
        request.id,
        tuple(inputs),
        tuple([output.name for output in outputs]) if outputs else (),
        _parameters(request.parameters) if request.parameters else {},
    )


def output_array(output: np.ndarray) -> tuple[np.ndarray, str]:
    """An output as little-endian contiguous values, with its KServe datatype (FP32, INT8 or UINT8)."""
    if output.dtype.kind in "iu":
        return np.ascontiguousarray(output), _INTEGER_DATATYPES[output.dtype.itemsize, output.dtype.kind]
    return np.ascontiguousarray(output, dtype=_FP32), "FP32"


PROMPT_TOKENS = "prompt_tokens"
"""The response parameter (int64) counting the request's real tokens, special tokens included (OpenAI's usage)."""


def encode_infer_response(result: InferenceResult) -> pb.ModelInferResponse:
    """Outputs as raw_output_contents, in the requested order; the request id echoed; its tokens counted."""
    response = pb.ModelInferResponse(model_name=result.model, model_version=result.version, id=result.id)
    response.parameters[PROMPT_TOKENS].int64_param = result.prompt_tokens
    for name, output in result.outputs.items():
        array, datatype = output_array(output)
        response.outputs.add(name=name, datatype=datatype, shape=array.shape)
        response.raw_output_contents.append(array.tobytes())
    return response


_INTEGER_DATATYPES = {(1, "i"): "INT8", (1, "u"): "UINT8", (8, "i"): "INT64"}
_METADATA_DATATYPES = {
    mc.TYPE_STRING: "BYTES",
    mc.TYPE_INT64: "INT64",
    mc.TYPE_FP32: "FP32",
    mc.TYPE_INT8: "INT8",
    mc.TYPE_UINT8: "UINT8",
}
_CONFIG_DATATYPES = {name: data_type for data_type, name in _METADATA_DATATYPES.items()}


def served_output_configs(signature: ModelSignature) -> list[mc.ModelOutput]:
    """The outputs as served, in Triton's terms: the graph's (config.pbtxt's), then the forms made from them.

    The compact embeddings (`embedding_int8`, ...: service.pipeline.embedding_types), sparse terms
    (`sparse_indices`, `sparse_values`: service.pipeline.sparse) and multi-vector outputs (`multivector`,
    `multivector_lengths`, `score`: service.pipeline.multivector) are made by the server from the graph's
    outputs, so config.pbtxt cannot declare them (Triton would look for them in the graph); the graph's
    per-position `token_vectors` and `token_weights` are served only through them. The token outputs
    (`token_ids`, `token_offsets`, `token_counts`) are answered but not declared: they are answered
    alone, and Triton's tools (perf_analyzer) ask for every declared output at once.
    """
    spec = signature.spec
    outputs = [output for output in spec.config.output if output.name in signature.outputs]
    for output in signature.outputs.values():
        if output.form is not None and output.source != TOKENS:
            if output.form == MULTIVECTOR:
                dims = [-1, spec.multivector_width]
            else:
                dims = [output_width(output, spec.hidden_size)]
            outputs.append(mc.ModelOutput(name=output.name, data_type=_CONFIG_DATATYPES[output.datatype], dims=dims))
    return outputs


def served_inputs(signature: ModelSignature) -> list[mc.ModelInput]:
    """The inputs as served, in Triton's terms; ModelConfig and ModelMetadata both list these.

    `text` (TYPE_STRING, one string per row) comes first when the server tokenises for the model.
    A classifier or a multi-vector model also takes `query` (row i is the pair (query[i], text[i])); a two-tower
    model `image` (one encoded image per row, in place of texts).
    Neither is an input of the ONNX graph, so config.pbtxt cannot hold them (Triton would refuse the
    file): the server adds them here. A request sends either the text or the token inputs, so every
    input is `optional` when text is accepted; otherwise only token_type_ids is.
    """
    inputs = []
    if signature.accepts_text:
        inputs.append(mc.ModelInput(name=TEXT_INPUT, data_type=mc.TYPE_STRING, dims=[1], optional=True))
        if QUERY_INPUT in signature.input_datatypes:
            inputs.append(mc.ModelInput(name=QUERY_INPUT, data_type=mc.TYPE_STRING, dims=[1], optional=True))
    if signature.accepts_images:
        inputs.append(mc.ModelInput(name=IMAGE_INPUT, data_type=mc.TYPE_STRING, dims=[1], optional=True))
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
    for tensor in served_output_configs(signature):
        response.outputs.add(name=tensor.name, datatype=_METADATA_DATATYPES[tensor.data_type], shape=[-1, *tensor.dims])
    return response


def effective_config(model: ModelInfo) -> mc.ModelConfig:
    """config.pbtxt as served: batching limits in force, and the device and variant of every instance."""
    config = mc.ModelConfig()
    config.CopyFrom(model.spec.config)
    del config.input[:]
    config.input.extend(served_inputs(model.signature))
    outputs = served_output_configs(model.signature)
    del config.output[:]
    config.output.extend(outputs)
    config.max_batch_size = model.policy.max_batch_size
    config.dynamic_batching.max_queue_delay_microseconds = round(model.policy.max_queue_delay_s * 1e6)
    config.dynamic_batching.default_queue_policy.max_queue_size = model.policy.max_queue_size
    config.dynamic_batching.priority_levels = model.policy.priority_levels
    config.dynamic_batching.default_priority_level = model.policy.default_priority
    del config.instance_group[:]
    on_gpu = [instance for instance in model.instances if instance.provider == "CUDAExecutionProvider"]
    if on_gpu:
        gpus = sorted({instance.cuda_device_id for instance in on_gpu})
        config.instance_group.add(count=len(on_gpu), kind=mc.ModelInstanceGroup.KIND_GPU, gpus=gpus)
    if len(on_gpu) < len(model.instances):
        config.instance_group.add(count=len(model.instances) - len(on_gpu), kind=mc.ModelInstanceGroup.KIND_CPU)
    config.parameters["execution_provider"].string_value = ",".join(sorted({i.provider for i in model.instances}))
    config.parameters["variant"].string_value = ",".join(sorted({i.variant for i in model.instances}))
    return config


def _duration(duration: Duration) -> pb.StatisticDuration:
    return pb.StatisticDuration(count=duration.count, ns=duration.ns)


def model_statistics(name: str, version: str, statistics: ModelStatistics) -> pb.ModelStatistics:
    """Triton's ModelStatistics message of one model version, batch sizes in increasing order."""
    return pb.ModelStatistics(
        name=name,
        version=version,
        last_inference=statistics.last_inference_ms,
        inference_count=statistics.inference_count,
        execution_count=statistics.execution_count,
        inference_stats=pb.InferStatistics(
            success=_duration(statistics.success),
            fail=_duration(statistics.fail),
            queue=_duration(statistics.queue),
            compute_input=_duration(statistics.compute_input),
            compute_infer=_duration(statistics.compute_infer),
            compute_output=_duration(statistics.compute_output),
        ),
        batch_stats=[
            pb.InferBatchStatistics(batch_size=rows, compute_infer=_duration(duration))
            for rows, duration in sorted(statistics.batch_infer.items())
        ],
    )
