"""Where a model's instances run: what the core reports of each, in this process or over the engine's wire."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InstanceInfo:
    """Where one model instance runs."""

    provider: str
    """The ONNX Runtime execution provider its session runs on."""
    variant: str
    cuda_device_id: int
    """The CUDA device ordinal (meaningful on CUDAExecutionProvider only)."""
