"""Execution provider selection, CPU fallback, variants and the batch contract, with real sessions."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from service.repository import read_model
from service.runtime import (
    CPU,
    CUDA,
    BatchContractError,
    ExecutionError,
    ExecutionSettings,
    ModelRuntime,
    choose_variant,
    cuda_provider_options,
    wants_cuda,
)
from tests.conftest import DEFAULT_MODEL, TINY_MODEL
from tests.servers import cuda_usable


def feed(rows: int, length: int) -> dict[str, np.ndarray]:
    return {
        "input_ids": np.full((rows, length), 2023, dtype=np.int64),
        "attention_mask": np.ones((rows, length), dtype=np.int64),
        "token_type_ids": np.zeros((rows, length), dtype=np.int64),
    }


def test_provider_choice() -> None:
    assert wants_cuda(ExecutionSettings(device="cpu"), [CUDA, CPU]) is False
    assert wants_cuda(ExecutionSettings(), [CUDA, CPU]) is True
    assert wants_cuda(ExecutionSettings(), [CPU]) is False
    with pytest.raises(ExecutionError, match="a GPU is required"):
        wants_cuda(ExecutionSettings(require_gpu=True), [CPU])


def test_variant_choice_follows_the_repository_preference(default_repository: Path) -> None:
    spec = read_model(default_repository / DEFAULT_MODEL)
    assert choose_variant(spec, ExecutionSettings(), "cuda") == "fp16"
    assert choose_variant(spec, ExecutionSettings(), "cpu") == spec.preferred_variants["cpu"]
    assert choose_variant(spec, ExecutionSettings(variant="fp32"), "cuda") == "fp32"
    without_fp16 = dataclasses.replace(spec, variants={"fp32": spec.variants["fp32"]})
    assert choose_variant(without_fp16, ExecutionSettings(), "cuda") == "fp32"
    with pytest.raises(ExecutionError, match="variant fp16 is not published"):
        choose_variant(without_fp16, ExecutionSettings(variant="fp16"), "cpu")


def test_cuda_options_carry_the_memory_settings() -> None:
    options = cuda_provider_options(
        ExecutionSettings(cuda_device_id=1, gpu_mem_limit_bytes=2**30, arena_extend_strategy="kNextPowerOfTwo")
    )
    assert options["device_id"] == "1"
    assert options["gpu_mem_limit"] == str(2**30)
    assert options["arena_extend_strategy"] == "kNextPowerOfTwo"
    assert "gpu_mem_limit" not in cuda_provider_options(ExecutionSettings())


@pytest.mark.skipif(cuda_usable(), reason="checks the fallback on a machine without a usable GPU")
def test_without_a_gpu_auto_falls_back_to_cpu_and_require_gpu_refuses(default_repository: Path) -> None:
    spec = read_model(default_repository / DEFAULT_MODEL)
    runtime = ModelRuntime(spec, ExecutionSettings(intra_op_threads=1))
    assert runtime.provider == CPU
    assert runtime.variant == spec.preferred_variants["cpu"]
    assert runtime.fell_back_to_cpu is (CUDA in ort.get_available_providers())
    with pytest.raises(ExecutionError):
        ModelRuntime(spec, ExecutionSettings(intra_op_threads=1, require_gpu=True))


def test_cpu_device_never_tries_cuda(tiny_repository: Path) -> None:
    runtime = ModelRuntime(read_model(tiny_repository / TINY_MODEL), ExecutionSettings(device="cpu"))
    assert runtime.provider == CPU and not runtime.fell_back_to_cpu
    outputs = runtime.run(feed(3, 5), ("embedding", "last_hidden_state"))
    assert outputs["embedding"].shape == (3, 32) and outputs["last_hidden_state"].shape == (3, 5, 32)


def _wrong_batch_model(path: Path) -> None:
    """A graph that ignores the batch: always one row out."""
    inputs = [
        helper.make_tensor_value_info(name, TensorProto.INT64, ["batch", "sequence"])
        for name in ("input_ids", "attention_mask", "token_type_ids")
    ]
    constant = helper.make_tensor("one_row", TensorProto.FLOAT, [1, 32], [0.5] * 32)
    nodes = [
        helper.make_node("Constant", [], ["embedding"], value=constant),
        helper.make_node(
            "Constant",
            [],
            ["last_hidden_state"],
            value=helper.make_tensor("h", TensorProto.FLOAT, [1, 1, 32], [0.5] * 32),
        ),
    ]
    outputs = [
        helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, [1, 1, 32]),
        helper.make_tensor_value_info("embedding", TensorProto.FLOAT, [1, 32]),
    ]
    graph = helper.make_graph(nodes, "wrong", inputs, outputs)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), str(path))


def test_batch_contract_is_checked_loudly(repository_copy: Path) -> None:
    _wrong_batch_model(repository_copy / TINY_MODEL / "1" / "model.onnx")
    runtime = ModelRuntime(read_model(repository_copy / TINY_MODEL), ExecutionSettings(device="cpu"))
    with pytest.raises(BatchContractError, match=r"output embedding is float32\[1, 32\], expected float32\[2, 32\]"):
        runtime.run(feed(2, 4), ("embedding",))


@pytest.mark.gpu
def test_cuda_session_runs_fp16_and_agrees_with_cpu(default_repository: Path) -> None:
    spec = read_model(default_repository / DEFAULT_MODEL)
    gpu = ModelRuntime(spec, ExecutionSettings(require_gpu=True, intra_op_threads=1))
    cpu = ModelRuntime(spec, ExecutionSettings(device="cpu", variant="fp32", intra_op_threads=1))
    assert gpu.provider == CUDA and gpu.variant == "fp16"
    batch = feed(4, 16)
    a = gpu.run(batch, ("embedding",))["embedding"]
    b = cpu.run(batch, ("embedding",))["embedding"]
    assert ((a * b).sum(axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min() >= 0.999
