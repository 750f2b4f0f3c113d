"""One tower of a two-tower model (CLIP, SigLIP: export.layers.vision) -> an ONNX graph with a dynamic batch axis.

An image tower's graph takes pixel_values [batch, channels, size, size] (the size fixed: its position
embeddings cover that many patches); a text tower's takes input_ids and attention_mask [batch, sequence].
Both answer embedding [batch, width]. Traced with the TorchScript exporter at the text graphs' opset
(export.graph.onnx_export).
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import onnx
import torch

from export.graph.onnx_export import OPSET, save_onnx
from export.layers.vision import ImageTower, TextTower

TRACE_BATCH = 2
"""Rows in the example the tower is traced with (not 1, so that no batch size is folded into the graph)."""

log = logging.getLogger(__name__)


def export_tower(tower: ImageTower | TextTower, path: Path) -> None:
    """Trace the tower (eval mode) and write a checked graph; its embedding's width is declared fixed."""
    with torch.no_grad():
        width = int(tower(*tower.example_inputs(1)).shape[-1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            tower.eval(),
            tower.example_inputs(TRACE_BATCH),
            str(path),
            dynamo=False,
            opset_version=OPSET,
            input_names=list(tower.input_names),
            output_names=list(tower.output_names),
            dynamic_axes=tower.dynamic_axes,
            do_constant_folding=True,
        )
    graph = onnx.load(str(path))
    for output in graph.graph.output:
        batch, embedding = output.type.tensor_type.shape.dim
        batch.dim_param, embedding.dim_value = "batch", width
    save_onnx(graph, path)
    onnx.checker.check_model(str(path), full_check=True)
    log.info("exported %s (%d nodes)", path, len(graph.graph.node))
