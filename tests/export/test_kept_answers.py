"""A published variant's checks share its session's answers: a feed made twice runs once, another feed runs."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from export.gate.references.loop import KeptAnswers


def _doubling_session() -> ort.InferenceSession:
    """A graph that answers `doubled` = `x` + `x` (float32 [rows, columns])."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "x"], ["doubled"])],
        "doubling",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, None])],
        [helper.make_tensor_value_info("doubled", TensorProto.FLOAT, [None, None])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_the_same_feed_is_answered_once_and_another_feed_is_run() -> None:
    answers = KeptAnswers(_doubling_session())
    first = answers.run(["doubled"], {"x": np.arange(6, dtype=np.float32).reshape(2, 3)})
    again = answers.run(["doubled"], {"x": np.arange(6, dtype=np.float32).reshape(2, 3)})
    other = answers.run(["doubled"], {"x": np.arange(6, dtype=np.float32).reshape(3, 2)})
    assert again is first
    np.testing.assert_array_equal(first[0], 2 * np.arange(6, dtype=np.float32).reshape(2, 3))
    np.testing.assert_array_equal(other[0], 2 * np.arange(6, dtype=np.float32).reshape(3, 2))
    assert answers.get_providers()[0] == "CPUExecutionProvider"
