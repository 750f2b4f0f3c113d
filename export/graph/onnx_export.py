"""PyTorch encoder (or classifier) -> ONNX graph with dynamic batch and sequence axes."""

from __future__ import annotations

import logging
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import onnx
import torch
from google.protobuf.message import EncodeError
from onnx.external_data_helper import ExternalDataInfo, uses_external_data
from torch import nn

from export.families.family import EncoderSettings
from export.heads.registry import graph_outputs
from service.core.repository import ADAPTER_IDS

OPSET = 17
# Protobuf's 2 GiB message limit: larger models keep their weights beside the graph.
EXTERNAL_DATA_THRESHOLD_BYTES = 1_800_000_000
WEIGHT_ALIGNMENT_BYTES = 4096
"""Where each external weight starts: a page boundary."""

log = logging.getLogger(__name__)


def input_names(config: EncoderSettings) -> list[str]:
    """The graph's inputs, in order: token_type_ids only with segments, adapter_ids only with task adapters."""
    names = ["input_ids", "attention_mask"]
    if config.uses_segments:
        names.append("token_type_ids")
    if getattr(config, "tasks", ()):
        names.append(ADAPTER_IDS)
    return names


def too_large_for_one_file(model_proto: onnx.ModelProto) -> bool:
    """Whether a graph's weights must go beside it: over the threshold, or past what protobuf can even measure.

    Protobuf refuses to size (or write) a message over 2 GiB (EncodeError): jina-embeddings-v3 and
    the 0.6B Qwen3 models in fp32 are such graphs.
    """
    try:
        return model_proto.ByteSize() > EXTERNAL_DATA_THRESHOLD_BYTES
    except EncodeError:
        return True


def save_onnx(model_proto: onnx.ModelProto, path: Path) -> None:
    """Write a graph, moving weights to an external data file when the graph would be too large."""
    large = too_large_for_one_file(model_proto)
    onnx.save_model(
        model_proto,
        str(path),
        save_as_external_data=large,
        all_tensors_to_one_file=True,
        location=f"{path.name}.data" if large else None,
    )


def _tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Every tensor a graph holds: its initializers and its nodes' tensor attributes, subgraphs included."""
    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t
            yield from attribute.tensors
            for subgraph in (*([attribute.g] if attribute.HasField("g") else []), *attribute.graphs):
                yield from _tensors(subgraph)


def _point_to(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    """Say where an external tensor's bytes are (onnx's set_external_data wants the bytes in memory)."""
    del tensor.external_data[:]
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


def gather_weights(graph: onnx.ModelProto, path: Path) -> None:
    """Move a graph's external weights (wherever beside it they are) into one file, PATH.data, a tensor at a time.

    Each tensor starts at a multiple of WEIGHT_ALIGNMENT_BYTES (ONNX Runtime maps aligned weights rather than
    reading them); the files the weights came from are removed.
    """
    data = path.parent / f"{path.name}.data"
    writing = path.parent / f"{data.name}.partial"
    sources = set()
    with writing.open("wb") as gathered:
        for tensor in _tensors(graph.graph):
            if not uses_external_data(tensor):
                continue
            info = ExternalDataInfo(tensor)
            source = path.parent / info.location
            with source.open("rb") as scattered:
                scattered.seek(info.offset or 0)
                raw = scattered.read(info.length or -1)
            gathered.write(b"\0" * (-gathered.tell() % WEIGHT_ALIGNMENT_BYTES))
            offset = gathered.tell()
            gathered.write(raw)
            _point_to(tensor, data.name, offset, len(raw))
            sources.add(source)
    for source in sources:
        source.unlink()
    writing.rename(data)


def copy_onnx(source: Path, target: Path) -> None:
    """Copy a graph saved by save_onnx to another name, its external weights (if any) renamed with it.

    Only the graph's structure is loaded: the weights file is copied as bytes, never held in memory
    (a 0.6B model's 2.4 GB would be, twice, by a load and a save).
    """
    graph = onnx.load(str(source), load_external_data=False)
    tensors = [tensor for tensor in _tensors(graph.graph) if uses_external_data(tensor)]
    locations = {entry.value for tensor in tensors for entry in tensor.external_data if entry.key == "location"}
    if not tensors:
        shutil.copyfile(source, target)
        return
    if len(locations) != 1:
        save_onnx(onnx.load(str(source)), target)
        return
    data = f"{target.name}.data"
    for tensor in tensors:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = data
    shutil.copyfile(source.parent / locations.pop(), target.parent / data)
    onnx.save_model(graph, str(target))


def output_shapes(model: nn.Module) -> dict[str, tuple[str | int, ...]]:
    """Each output's shape, as the model's head declares it: named dynamic axes and fixed widths."""
    outputs = graph_outputs(model.config, getattr(model, "head_config", None))
    return {output.name: ("batch", *output.dims) for output in outputs}


def _declare_output_shapes(graph: onnx.ModelProto, shapes: dict[str, tuple[str | int, ...]]) -> None:
    """Name the dynamic axes of the outputs and fix their width (tracing leaves e.g. "Divembedding_dim_1")."""
    for output in graph.graph.output:
        dims = output.type.tensor_type.shape.dim
        for dim, wanted in zip(dims, shapes[output.name], strict=True):
            if isinstance(wanted, int):
                dim.dim_value = wanted
            else:
                dim.dim_param = wanted


def export_onnx(model: nn.Module, path: Path) -> None:
    """Trace the encoder with the TorchScript exporter and write a checked opset-17 graph.

    The TorchScript exporter is used on purpose: its plain MatMul/Softmax attention is the form
    ONNX Runtime's transformer optimiser can fuse (the dynamo exporter's graph is not).
    """
    names = input_names(model.config)
    # input_ids and attention_mask by position, the optional inputs by name (adapter_ids may come without segments).
    ones = torch.ones(2, 8, dtype=torch.int64)
    example = (ones, ones, {name: ones for name in names[2:]})
    shapes = output_shapes(model)
    dynamic_axes = {name: {0: "batch", 1: "sequence"} for name in names}
    for output, shape in shapes.items():
        dynamic_axes[output] = {axis: dim for axis, dim in enumerate(shape) if isinstance(dim, str)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            example,
            str(path),
            dynamo=False,
            opset_version=OPSET,
            input_names=names,
            output_names=list(shapes),
            dynamic_axes=dynamic_axes,
            do_constant_folding=True,
        )
    # The weights stay where the exporter wrote them (a large model's: one file per tensor beside the graph)
    # until they are gathered into one file a tensor at a time: never the whole model in memory here.
    graph = onnx.load(str(path), load_external_data=False)
    _declare_output_shapes(graph, shapes)
    if any(uses_external_data(tensor) for tensor in _tensors(graph.graph)):
        gather_weights(graph, path)
        onnx.save_model(graph, str(path))
    else:
        save_onnx(graph, path)
    onnx.checker.check_model(str(path), full_check=True)
    log.info("exported %s (%d nodes)", path, len(graph.graph.node))
