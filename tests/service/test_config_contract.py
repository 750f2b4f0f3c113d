"""The contract with Triton's tools: the whole GRPCInferenceService declared as Triton declares it,
ModelConfig and ModelMetadata in agreement and in Triton's conventions, config.pbtxt loadable by Triton.

Triton's own protos (tritonclient's service_pb2 and model_config_pb2) judge, not ours.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import onnx
import pytest
import tritonclient.grpc as triton
from google.protobuf import descriptor, descriptor_pool, text_format
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from tritonclient.grpc import model_config_pb2 as triton_config
from tritonclient.grpc import service_pb2 as triton_service

from protocol import grpc_service_pb2 as pb
from protocol import grpc_service_pb2_grpc as pb_grpc
from protocol import model_config_pb2 as mc
from service.core.repository import CONFIG_FILE, read_model
from service.frontends.codec import served_inputs
from service.pipeline.requests import ModelSignature
from tests.conftest import TINY_MODEL
from tests.servers import RunningServer

METADATA_DATATYPE = {
    triton_config.TYPE_STRING: "BYTES",
    triton_config.TYPE_INT64: "INT64",
    triton_config.TYPE_FP32: "FP32",
    triton_config.TYPE_INT8: "INT8",
    triton_config.TYPE_UINT8: "UINT8",
}


UNSUPPORTED = (
    "RepositoryModelLoad",
    "RepositoryModelUnload",
    "SystemSharedMemoryStatus",
    "SystemSharedMemoryRegister",
    "SystemSharedMemoryUnregister",
    "CudaSharedMemoryStatus",
    "CudaSharedMemoryRegister",
    "CudaSharedMemoryUnregister",
    "TraceSetting",
    "LogSettings",
)


@pytest.fixture(scope="module")
def client(tiny_server: RunningServer) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(tiny_server.target)


def _dims(value_info: onnx.ValueInfoProto) -> list[int]:
    """An ONNX tensor's dimensions in Triton's terms: named (symbolic) dimensions are -1."""
    return [d.dim_value if d.HasField("dim_value") else -1 for d in value_info.type.tensor_type.shape.dim]


def test_exported_config_is_parsed_strictly_by_tritons_model_config_and_matches_the_graph(
    tiny_repository: Path,
) -> None:
    folder = tiny_repository / TINY_MODEL
    config = text_format.Parse((folder / CONFIG_FILE).read_text(), triton_config.ModelConfig())
    graph = onnx.load(folder / "1" / config.default_model_filename, load_external_data=False).graph
    # Triton's ONNX Runtime backend refuses a config input the graph lacks: `text` is served, not stored.
    assert config.max_batch_size > 0
    graph_inputs = {tensor.name: _dims(tensor) for tensor in graph.input}
    assert [tensor.name for tensor in config.input] == list(graph_inputs)
    for tensor in config.input:
        assert [-1, *tensor.dims] == graph_inputs[tensor.name], tensor.name
        assert tensor.data_type == triton_config.TYPE_INT64 and not tensor.optional
    graph_outputs = {tensor.name: _dims(tensor) for tensor in graph.output}
    assert {tensor.name for tensor in config.output} == set(graph_outputs)
    for tensor in config.output:
        assert [-1, *tensor.dims] == graph_outputs[tensor.name], tensor.name


def test_served_config_declares_text_and_tokens_as_optional_alternatives(client: triton.InferenceServerClient) -> None:
    config = client.get_model_config(TINY_MODEL).config
    assert [(i.name, i.data_type, list(i.dims), i.optional) for i in config.input] == [
        ("text", triton_config.TYPE_STRING, [1], True),
        ("input_ids", triton_config.TYPE_INT64, [-1], True),
        ("attention_mask", triton_config.TYPE_INT64, [-1], True),
        ("token_type_ids", triton_config.TYPE_INT64, [-1], True),
    ]
    # The served config, written out, is still a config Triton's parser accepts field for field.
    reparsed = text_format.Parse(text_format.MessageToString(config), triton_config.ModelConfig())
    assert reparsed == config


def test_metadata_agrees_with_the_served_config(client: triton.InferenceServerClient) -> None:
    config = client.get_model_config(TINY_MODEL).config
    metadata = client.get_model_metadata(TINY_MODEL)
    assert config.max_batch_size > 0  # so metadata shapes are the config's dims behind a batch dimension
    for declared, described in ((config.input, metadata.inputs), (config.output, metadata.outputs)):
        assert [(t.name, t.datatype, list(t.shape)) for t in described] == [
            (t.name, METADATA_DATATYPE[t.data_type], [-1, *t.dims]) for t in declared
        ]


def test_each_declared_form_is_accepted_as_tritons_tools_send_it(client: triton.InferenceServerClient) -> None:
    """Text as [batch, 1] (the config's dims behind the batch), and tokens without the optional token_type_ids."""
    texts = np.array([[b"A man is eating food."], [b"A dog runs."]], dtype=object)
    text = triton.InferInput("text", [2, 1], "BYTES")
    text.set_data_from_numpy(texts)
    from_text = client.infer(TINY_MODEL, [text]).as_numpy("embedding")
    flat = triton.InferInput("text", [2], "BYTES")
    flat.set_data_from_numpy(texts.reshape(2))
    np.testing.assert_array_equal(client.infer(TINY_MODEL, [flat]).as_numpy("embedding"), from_text)
    ids = np.array([[101, 1037, 2158, 102]], dtype=np.int64)
    tokens = [triton.InferInput("input_ids", [1, 4], "INT64"), triton.InferInput("attention_mask", [1, 4], "INT64")]
    tokens[0].set_data_from_numpy(ids)
    tokens[1].set_data_from_numpy(np.ones_like(ids))
    assert client.infer(TINY_MODEL, tokens).as_numpy("embedding").shape == (1, from_text.shape[1])


def test_without_a_tokenizer_only_the_segment_ids_are_optional(tiny_repository: Path) -> None:
    spec = read_model(tiny_repository / TINY_MODEL)
    inputs = served_inputs(ModelSignature(spec, accepts_text=False, max_batch_size=spec.max_batch_size))
    assert [(i.name, i.data_type, i.optional) for i in inputs] == [
        ("input_ids", mc.TYPE_INT64, False),
        ("attention_mask", mc.TYPE_INT64, False),
        ("token_type_ids", mc.TYPE_INT64, True),
    ]


def _fields_within(ours: descriptor.Descriptor, theirs: descriptor.Descriptor, seen: set[str]) -> None:
    """Every field we declare is Triton's (number, type, repeated), recursively; grpc_service messages entirely.

    model_config.proto holds only the part of Triton's ModelConfig this project reads and writes.
    """
    if ours.full_name in seen:
        return
    seen.add(ours.full_name)
    assert ours.full_name == theirs.full_name
    if ours.file.name == "grpc_service.proto":
        assert set(ours.fields_by_name) == set(theirs.fields_by_name), ours.full_name
    for name, field in ours.fields_by_name.items():
        other = theirs.fields_by_name.get(name)
        assert other is not None, f"{ours.full_name}.{name} is not Triton's"
        assert (field.number, field.type, field.is_repeated) == (other.number, other.type, other.is_repeated), name
        if field.message_type is not None:
            _fields_within(field.message_type, other.message_type, seen)


def test_reflection_shows_tritons_whole_service_as_triton_declares_it(tiny_server: RunningServer) -> None:
    with grpc.insecure_channel(tiny_server.target) as channel:
        pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
        served = pool.FindServiceByName("inference.GRPCInferenceService")
        tritons = triton_service.DESCRIPTOR.services_by_name["GRPCInferenceService"]
        assert [m.name for m in served.methods] == [m.name for m in tritons.methods]
        seen: set[str] = set()
        for method in served.methods:
            other = tritons.methods_by_name[method.name]
            assert (method.client_streaming, method.server_streaming) == (
                other.client_streaming,
                other.server_streaming,
            ), method.name
            _fields_within(method.input_type, other.input_type, seen)
            _fields_within(method.output_type, other.output_type, seen)


@pytest.mark.parametrize("method", UNSUPPORTED)
def test_the_methods_not_offered_answer_unimplemented_with_the_reason(tiny_server: RunningServer, method: str) -> None:
    request_type = getattr(pb, f"{method}Request")
    with grpc.insecure_channel(tiny_server.target) as channel, pytest.raises(grpc.RpcError) as refused:
        getattr(pb_grpc.GRPCInferenceServiceStub(channel), method)(request_type(), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert refused.value.details().startswith(f"{method} is not supported by this server: ")


def test_tritonclient_sees_unimplemented_for_model_loading(client: triton.InferenceServerClient) -> None:
    with pytest.raises(triton.InferenceServerException) as refused:
        client.load_model(TINY_MODEL)
    assert refused.value.status() == str(grpc.StatusCode.UNIMPLEMENTED)
