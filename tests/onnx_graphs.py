"""Hand-built ONNX graphs with the served signature, for tests that need a model to misbehave on cue.

Each graph takes the three token inputs and answers `embedding` (batch x 32, built by the caller's
nodes from `ids`, the input ids as floats) and `last_hidden_state` (each id repeated 32 times).
"""

from __future__ import annotations

import struct
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from protocol import grpc_service_pb2 as pb

WIDTH = 32
"""Embedding width of every graph here."""
SLOW_ID = 29999
"""The first token id that makes `slow_on_demand_model` slow."""
TURNS = 4_000_000
"""Loop turns of the slow input by default: seconds of ONNX Runtime's time."""


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


def _loop_when(is_slow: str, turns: int) -> list[onnx.NodeProto]:
    """Nodes making `carried` (float [1], 0): a Loop of `turns` empty turns when `is_slow` (bool [1, 1]), else none."""
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["condition_in"], ["condition_out"]),
            helper.make_node("Identity", ["carried_in"], ["carried_out"]),
        ],
        "turn",
        [
            helper.make_tensor_value_info("turn", TensorProto.INT64, []),
            helper.make_tensor_value_info("condition_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("carried_in", TensorProto.FLOAT, [1]),
        ],
        [
            helper.make_tensor_value_info("condition_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("carried_out", TensorProto.FLOAT, [1]),
        ],
    )
    return [
        helper.make_node("Cast", [is_slow], ["is_slow_count"], to=TensorProto.INT64),
        constant("turns", [turns]),
        helper.make_node("Mul", ["is_slow_count", "turns"], ["trip_vector"]),
        constant("scalar", []),
        helper.make_node("Reshape", ["trip_vector", "scalar"], ["trip"]),
        helper.make_node("Constant", [], ["keep_going"], value=helper.make_tensor("t", TensorProto.BOOL, [], [True])),
        constant("zero", [0], TensorProto.FLOAT),
        helper.make_node("Loop", ["trip", "keep_going", "zero"], ["carried"], body=body),
    ]


def slow_on_demand_model(path: Path, turns: int = TURNS) -> None:
    """embedding[b] = sum of row b's ids (x32); a Loop whose trip count is `turns` when ids[0][0] == SLOW_ID."""
    nodes = [
        # Trip count: TURNS if the first id is SLOW_ID, else 0.
        constant("first", [0]),
        helper.make_node("Flatten", ["input_ids"], ["flat"], axis=0),
        helper.make_node("Gather", ["flat", "first"], ["first_id"], axis=1),
        constant("slow_id", [SLOW_ID]),
        helper.make_node("Equal", ["first_id", "slow_id"], ["is_slow"]),
        *_loop_when("is_slow", turns),
        constant("row_axes", [1]),
        helper.make_node("ReduceSum", ["ids", "row_axes"], ["row_sums"], keepdims=1),
        helper.make_node("Add", ["row_sums", "carried"], ["row_sums_kept"]),  # keeps the Loop in the graph
        constant("widths", [1, WIDTH]),
        helper.make_node("Tile", ["row_sums_kept", "widths"], ["embedding"]),
    ]
    save_token_graph(path, "slow_on_demand", nodes)


def slow_on_demand_image_model(path: Path, size: int, width: int, turns: int = TURNS) -> None:
    """An image tower's graph (pixel_values [batch, 3, size, size] -> embedding [batch, width]): each row's first
    `width` pixel values; a Loop whose trip count is `turns` when the batch's first pixel value is above 0 (a
    white image, normalised), none for a black one.
    """
    nodes = [
        constant("first", [0]),
        helper.make_node("Flatten", ["pixel_values"], ["flat"], axis=0),
        helper.make_node("Gather", ["flat", "first"], ["first_value"], axis=1),
        constant("bright", [0], TensorProto.FLOAT),
        helper.make_node("Greater", ["first_value", "bright"], ["is_slow"]),
        *_loop_when("is_slow", turns),
        helper.make_node("Flatten", ["pixel_values"], ["rows"], axis=1),
        constant("starts", [0]),
        constant("ends", [width]),
        constant("axes", [1]),
        helper.make_node("Slice", ["rows", "starts", "ends", "axes"], ["firsts"]),
        helper.make_node("Add", ["firsts", "carried"], ["embedding"]),  # keeps the Loop in the graph
    ]
    inputs = [helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT, ["batch", 3, size, size])]
    outputs = [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", width])]
    graph = helper.make_graph(nodes, "slow_on_demand_image", inputs, outputs)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), str(path))


def token_request(model: str, ids: list[int]) -> pb.ModelInferRequest:
    """A ModelInfer of one row of token ids (all attended), asking for the embedding."""
    request = pb.ModelInferRequest(model_name=model)
    for name, values in (("input_ids", ids), ("attention_mask", [1] * len(ids))):
        request.inputs.add(name=name, datatype="INT64", shape=[1, len(ids)])
        request.raw_input_contents.append(struct.pack(f"<{len(ids)}q", *values))
    request.outputs.add(name="embedding")
    return request
