"""Graph files with external weights: gathered into one file a tensor at a time, copied without loading them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import set_external_data, uses_external_data

from export.graph.onnx_export import WEIGHT_ALIGNMENT_BYTES, copy_onnx, gather_weights

WEIGHT = np.arange(6, dtype=np.float32).reshape(2, 3)
OFFSET = np.array([10.0, 20.0, 30.0], dtype=np.float32)


def _scattered(folder: Path, raw: bytes, name: str, tensor: TensorProto) -> TensorProto:
    """The tensor's bytes in their own file (as the TorchScript exporter leaves a large model's), behind some bytes."""
    (folder / name).write_bytes(b"skip" + raw)
    set_external_data(tensor, name, offset=4, length=len(raw))
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    return tensor


def _graph_with_scattered_weights(folder: Path) -> Path:
    """y = x @ WEIGHT + OFFSET: WEIGHT an initializer, OFFSET a Constant node's attribute, each in its own file."""
    weight = _scattered(folder, WEIGHT.tobytes(), "weight.bin", numpy_helper.from_array(WEIGHT, "weight"))
    offset = _scattered(folder, OFFSET.tobytes(), "offset.bin", numpy_helper.from_array(OFFSET, "offset_value"))
    nodes = [
        helper.make_node("Constant", [], ["offset"], value=offset),
        helper.make_node("MatMul", ["x", "weight"], ["product"]),
        helper.make_node("Add", ["product", "offset"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "scattered",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])],
        initializer=[weight],
    )
    path = folder / "model.onnx"
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    return path


def _answer(path: Path) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(["y"], {"x": np.array([[1.0, 2.0]], dtype=np.float32)})[0]


def test_scattered_weights_are_gathered_into_one_aligned_file(tmp_path: Path) -> None:
    path = _graph_with_scattered_weights(tmp_path)
    expected = np.array([[1.0, 2.0]], dtype=np.float32) @ WEIGHT + OFFSET
    np.testing.assert_array_equal(_answer(path), expected)
    graph = onnx.load(str(path), load_external_data=False)
    gather_weights(graph, path)
    onnx.save_model(graph, str(path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.onnx.data"]
    np.testing.assert_array_equal(_answer(path), expected)
    offsets = [
        int(entry.value)
        for tensor in [*graph.graph.initializer, graph.graph.node[0].attribute[0].t]
        for entry in tensor.external_data
        if entry.key == "offset"
    ]
    assert len(offsets) == 2 and all(offset % WEIGHT_ALIGNMENT_BYTES == 0 for offset in offsets)


def test_a_graph_is_copied_with_its_weights_renamed(tmp_path: Path) -> None:
    source = _graph_with_scattered_weights(tmp_path)
    graph = onnx.load(str(source), load_external_data=False)
    gather_weights(graph, source)
    onnx.save_model(graph, str(source))
    target = tmp_path / "copy" / "model.fp32.onnx"
    target.parent.mkdir()
    copy_onnx(source, target)
    assert sorted(p.name for p in target.parent.iterdir()) == ["model.fp32.onnx", "model.fp32.onnx.data"]
    copied = onnx.load(str(target), load_external_data=False)
    assert all(uses_external_data(tensor) for tensor in copied.graph.initializer)
    source.with_name("model.onnx.data").unlink()  # the copy reads its own weights only
    np.testing.assert_array_equal(_answer(target), np.array([[1.0, 2.0]], dtype=np.float32) @ WEIGHT + OFFSET)


def test_a_graph_without_external_weights_is_copied_whole(tmp_path: Path) -> None:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "small",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])],
    )
    source = tmp_path / "small.onnx"
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(source))
    copy_onnx(source, tmp_path / "copied.onnx")
    assert (tmp_path / "copied.onnx").read_bytes() == source.read_bytes()
