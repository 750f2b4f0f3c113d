"""Rotary position embeddings (RoFormer's RoPE), as the encoders here use them.

A query or key vector of width d is turned, pair of dimensions by pair of dimensions, by an angle
proportional to its position: pair i (dimension i with dimension i + d/2, the "rotate half"
layout) turns by position · θ^(-2i/d). Linear scaling divides every frequency by a factor (the
positions are stretched). Angles are computed in fp32 at run time, so the graph takes any length.
"""

from __future__ import annotations

import torch
from torch import Tensor


def inverse_frequencies(head_dim: int, theta: float, linear_factor: float = 1.0) -> Tensor:
    """The angle per position of each of the head_dim / 2 dimension pairs [head_dim / 2], fp32."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    return 1.0 / (theta**exponents) / linear_factor


def rotary_angles(frequencies: Tensor, length: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(cos, sin) [length, head_dim] of positions 0..length-1, each pair's angle on both of its dimensions."""
    positions = torch.arange(length, device=frequencies.device, dtype=torch.float32)
    angles = positions[:, None] * frequencies[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Turn x [..., seq, head_dim] by the angles (cos, sin) [seq, head_dim] (the rotate-half layout)."""
    half = x.shape[-1] // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated_half * sin
