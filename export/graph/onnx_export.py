"""PyTorch encoder (or classifier) -> ONNX graph with dynamic batch and sequence axes."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import onnx
import torch
from google.protobuf.message import EncodeError
from torch import nn

from export.heads.registry import graph_outputs
from service.core.repository import ADAPTER_IDS

OPSET = 17
# Protobuf's 2 GiB message limit: larger models keep their weights beside the graph.
EXTERNAL_DATA_THRESHOLD_BYTES = 1_800_000_000

log = logging.getLogger(__name__)


def input_names(model: nn.Module) -> list[str]:
    """The graph's inputs, in order: token_type_ids only with segments, adapter_ids only with task adapters."""
    names = ["input_ids", "attention_mask"]
    if model.config.uses_segments:
        names.append("token_type_ids")
    if getattr(model.config, "tasks", ()):
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
    names = input_names(model)
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
    graph = onnx.load(str(path))
    _declare_output_shapes(graph, shapes)
    save_onnx(graph, path)
    onnx.checker.check_model(str(path), full_check=True)
    log.info("exported %s (%d nodes)", path, len(graph.graph.node))
