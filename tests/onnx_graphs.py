"""Hand-built ONNX graphs with the served signature, for tests that need a model to misbehave on cue.

Each graph takes the three token inputs and answers `embedding` (batch x 32, built by the caller's
nodes from `ids`, the input ids as floats) and `last_hidden_state` (each id repeated 32 times).
"""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto, helper

WIDTH = 32
"""Embedding width of every graph here."""


def constant(name: str, values: list[int], kind: int = TensorProto.INT64) -> onnx.NodeProto:
    """A 1-D constant tensor (an empty list gives a 0-element shape, for reshaping to a scalar)."""
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, kind, [len(values)], values))


def save_token_graph(path: Path, name: str, nodes: list[onnx.NodeProto]) -> None:
    """Save `nodes` as a served model: `ids` (float ids) is made first, `embedding` must be made by `nodes`."""
    inputs = [
        helper.make_tensor_value_info(input_name, TensorProto.INT64, ["batch", "sequence"])
        for input_name in ("input_ids", "attention_mask", "token_type_ids")
    ]
    every_node = [
        helper.make_node("Cast", ["input_ids"], ["ids"], to=TensorProto.FLOAT),
        *nodes,
        constant("last_axis", [-1]),
        helper.make_node("Unsqueeze", ["ids", "last_axis"], ["ids_3d"]),
        constant("hidden_tiles", [1, 1, WIDTH]),
        helper.make_node("Tile", ["ids_3d", "hidden_tiles"], ["last_hidden_state"]),
    ]
    outputs = [
        helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["batch", "sequence", WIDTH]),
        helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", WIDTH]),
    ]
    graph = helper.make_graph(every_node, name, inputs, outputs)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), str(path))
