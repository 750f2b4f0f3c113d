"""The last step of the encoders' self-attention: softmax over the biased scores, the values weighted, heads joined."""

from __future__ import annotations

import torch
from torch import Tensor


def attend(scores: Tensor, attention_bias: Tensor, value: Tensor, batch: int, length: int) -> Tensor:
    """softmax(scores + attention_bias)·V [batch, heads, seq, d_k], heads joined: [batch, seq, heads · d_k]."""
    weights = torch.softmax(scores + attention_bias, dim=-1)
    return torch.matmul(weights, value).transpose(1, 2).reshape(batch, length, -1)
