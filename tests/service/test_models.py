"""The model registry: readiness, lookups and refusals before any model is served."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.errors import NotFound, Unavailable
from service.models import ModelRegistry
from service.runtime import ExecutionError
from service.settings import Settings
from tests.conftest import TINY_MODEL


async def test_a_loading_model_is_unavailable_then_ready(tiny_repository: Path) -> None:
    registry = ModelRegistry(Settings(model_repository=tiny_repository, intra_op_threads=1))
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
    registry = ModelRegistry(Settings(model_repository=repository_copy, intra_op_threads=1))
    registry.discover()
    with pytest.raises(ExecutionError, match="cannot load"):
        await registry.load(TINY_MODEL)
    state = registry.states[TINY_MODEL]
    assert state.state == "UNAVAILABLE" and "cannot load" in state.reason
    with pytest.raises(Unavailable, match="failed to load"):
        registry.get(TINY_MODEL)
