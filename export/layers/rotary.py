"""Rotary position embeddings (RoFormer's RoPE), as the encoders here use them.

A query or key vector of width d is turned, pair of dimensions by pair of dimensions, by an angle
proportional to its position: pair i (dimension i with dimension i + d/2, the "rotate half"
layout) turns by position · θ^(-2i/d). Linear scaling divides every frequency by a factor (the
positions are stretched). cos and sin are tabled in fp32 once, for every position the model was
made for, and the graph slices the tables to the batch's length: an fp16 graph then holds cos and
sin rounded to fp16, as transformers' fp16 models have them (computed in fp32, then rounded),
rather than angles computed in fp16, which lose a position's exact value past 2048 and an angle's
fraction long before.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from export.checkpoints.architecture_error import ArchitectureError


def inverse_frequencies(head_dim: int, theta: float, linear_factor: float = 1.0) -> Tensor:
    """The angle per position of each of the head_dim / 2 dimension pairs [head_dim / 2], fp32."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    return 1.0 / (theta**exponents) / linear_factor


class RotaryTable(nn.Module):
    """cos and sin [max_positions, head_dim] of every position's angles (each pair's on both its dimensions)."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, linear_factor: float = 1.0) -> None:
        super().__init__()
        frequencies = inverse_frequencies(head_dim, theta, linear_factor)
        angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * frequencies[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, length: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(cos, sin) [length, head_dim] of positions 0..length-1, in dtype."""
        return self.cos[:length].to(dtype), self.sin[:length].to(dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Turn x [..., seq, head_dim] by the angles (cos, sin) [seq, head_dim] (the rotate-half layout)."""
    half = x.shape[-1] // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated_half * sin


def rope_theta(hf_config: dict) -> float:
    """The rotary base; anything but plain rotary angles (YaRN, linear, dynamic scaling…) is refused by name."""
    parameters = hf_config.get("rope_parameters") or {}
    scaling = hf_config.get("rope_scaling") or {}
    for source, declared in (("rope_parameters", parameters), ("rope_scaling", scaling)):
        kind = declared.get("rope_type", declared.get("type", "default"))
        if kind != "default":
            raise ArchitectureError(f"unsupported {source} rope_type {kind!r}: only default rotary angles")
    return float(parameters.get("rope_theta", hf_config.get("rope_theta", 10_000.0)))
