"""Activations by name, and the position-wise feed-forward network of the BERT-shaped post-norm encoders."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def activate(name: str, x: Tensor) -> Tensor:
    """X through the activation `name`: gelu, gelu_tanh (GELU's tanh form), relu, silu or tanh."""
    if name == "relu":
        return F.relu(x)
    if name == "silu":
        return F.silu(x)
    if name == "tanh":
        return torch.tanh(x)
    return F.gelu(x, approximate="tanh" if name == "gelu_tanh" else "none")


class FeedForward(nn.Module):
    """Position-wise feed-forward network: Linear, activation, Linear (export.families.bert, deberta)."""

    def __init__(self, d_model: int, ffn_dim: int, activation: str) -> None:
        super().__init__()
        self.inner = nn.Linear(d_model, ffn_dim)
        self.outer = nn.Linear(ffn_dim, d_model)
        self.activation = activation

    def forward(self, hidden: Tensor) -> Tensor:
        """Apply the network to every position independently."""
        return self.outer(activate(self.activation, self.inner(hidden)))
