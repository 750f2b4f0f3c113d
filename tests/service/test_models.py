"""The model registry: readiness, lookups and refusals before any model is served."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from service import metrics
from service.codec import InferenceRequest
from service.errors import NotFound, Unavailable
from service.models import ModelRegistry, ServedModel
from service.proto import model_config_pb2 as mc
from service.repository import read_model
from service.runtime import ExecutionError, ExecutionSettings, ModelRuntime
from service.servicer import effective_config
from service.settings import Settings
from tests.conftest import TINY_MODEL
from tests.servers import ROOT


async def test_a_loading_model_is_unavailable_then_ready(tiny_repository: Path) -> None:
    registry = ModelRegistry(Settings(model_repository=tiny_repository, device="cpu", intra_op_threads=1))
    assert registry.discover() == [TINY_MODEL]
    assert not registry.ready
    with pytest.raises(Unavailable, match=f"model {TINY_MODEL} is loading"):
        registry.get_for_inference(TINY_MODEL, "")
    with pytest.raises(NotFound, match="unknown model 'other'"):
        registry.get("other")
    model = await registry.load(TINY_MODEL)
    assert registry.ready and registry.get_for_inference(TINY_MODEL, "1") is model
    assert registry.states[TINY_MODEL].state == "READY"
    await registry.close(1)
    with pytest.raises(Unavailable, match="shutting down"):
        registry.get_for_inference(TINY_MODEL, "")


async def test_a_model_that_cannot_load_is_reported_with_its_reason(repository_copy: Path) -> None:
    (repository_copy / TINY_MODEL / "1" / "model.onnx").write_bytes(b"not an onnx graph")
    registry = ModelRegistry(Settings(model_repository=repository_copy, device="cpu", intra_op_threads=1))
    registry.discover()
    with pytest.raises(ExecutionError, match="cannot load"):
        await registry.load(TINY_MODEL)
    state = registry.states[TINY_MODEL]
    assert state.state == "UNAVAILABLE" and "cannot load" in state.reason
    with pytest.raises(Unavailable, match="failed to load"):
        registry.get(TINY_MODEL)


def _token_request(rows: int, length: int) -> InferenceRequest:
    tokens = {
        "input_ids": np.full((rows, length), 2023, dtype=np.int64),
        "attention_mask": np.ones((rows, length), dtype=np.int64),
        "token_type_ids": np.zeros((rows, length), dtype=np.int64),
    }
    return InferenceRequest(id="", texts=None, tokens=tokens, outputs=("embedding",), timeout_s=None)


async def test_bucketed_lengths_never_pass_the_models_maximum(tiny_repository: Path) -> None:
    """A bucket of 48 rounds 100 tokens up to 144, past the tiny model's 128 positions: capped at 128."""
    settings = Settings(model_repository=tiny_repository, device="cpu", intra_op_threads=1, length_bucket=48)
    registry = ModelRegistry(settings)
    registry.discover()
    try:
        model = await registry.load(TINY_MODEL)
        assert model.policy.padded_length(100) == 128 and model.policy.padded_length(20) == 48
        assert model.warm_up_shapes()[:-1] == [(1, 48), (1, 96), (1, 128)]
        result = await model.infer(_token_request(2, 100), deadline=None)
        assert result.outputs["embedding"].shape == (2, 32)
    finally:
        await registry.close(1)


def test_warm_up_covers_the_bucketed_lengths_and_the_largest_batch(tiny_repository: Path) -> None:
    spec = read_model(tiny_repository / TINY_MODEL)
    runtimes = [ModelRuntime(spec, ExecutionSettings(device="cpu"))]
    pool = ThreadPoolExecutor(1)
    try:
        budget = Settings(device="cpu", length_bucket=32, max_batch_tokens=1024, max_batch_size=64)
        shapes = ServedModel(spec, runtimes, budget, pool).warm_up_shapes()
        assert shapes == [(1, 32), (1, 64), (1, 96), (1, 128), (8, 128)]
        # A single row longer than the budget is still served, so it is warmed.
        tight = Settings(device="cpu", max_batch_tokens=100)
        assert ServedModel(spec, runtimes, tight, pool).warm_up_shapes() == [(1, 8), (1, 128)]
    finally:
        pool.shutdown()


async def test_every_instance_is_reported_in_metrics_and_model_config(tiny_repository: Path) -> None:
    registry = ModelRegistry(Settings(model_repository=tiny_repository, device="cpu", intra_op_threads=1, instances=2))
    registry.discover()
    try:
        model = await registry.load(TINY_MODEL)
        config = effective_config(model)
        assert [(group.kind, group.count) for group in config.instance_group] == [(mc.ModelInstanceGroup.KIND_CPU, 2)]
        assert config.parameters["execution_provider"].string_value == "CPUExecutionProvider"
        assert config.parameters["variant"].string_value == "fp32"
        gauge = metrics.PROVIDER.labels(TINY_MODEL, model.spec.version, "CPUExecutionProvider", "fp32")
        assert gauge._value.get() == 2
    finally:
        await registry.close(1)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--device", "cpu", "--require-gpu"], "require_gpu contradicts device cpu: choose one"),
        (
            ["--variant", "int8", "--require-gpu"],
            "require_gpu contradicts variant int8: the int8 variant runs on the CPU only",
        ),
    ],
)
def test_contradictory_device_settings_are_refused_at_start(
    tiny_repository: Path, flags: list[str], message: str
) -> None:
    command = [sys.executable, "-m", "service", "--model-repository", str(tiny_repository), *flags]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert (result.returncode, result.stderr.strip()) == (2, f"service: error: {message}")
