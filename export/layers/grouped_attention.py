"""Grouped-query self-attention with rotary positions, as the decoder-shaped families have it (Qwen3, Gemma, EuroBERT).

Q = x·W_Q, K = x·W_K, V = x·W_V, with `num_kv_heads` key/value heads each shared by
num_heads / num_kv_heads query heads; each query and key head is optionally normalised on its own
(Qwen3's and Gemma's q_norm / k_norm), then turned by its position's rotary angles (export.layers.rotary);
softmax(QKᵀ·scale + mask)·V in fp32, then W^O. The projections are named as transformers names
them (q_proj, k_proj, v_proj, o_proj, q_norm, k_norm), so the checkpoints' weights load unrenamed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor, nn

from export.layers.rotary import rotate


class GroupedAttentionConfig(Protocol):
    """The sizes a grouped-query attention is built from (Qwen3Config, EuroBertConfig, GemmaConfig have them)."""

    d_model: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attention_bias: bool


class GroupedQueryAttention(nn.Module):
    """softmax(QKᵀ·scale + attention_bias)·V over grouped key/value heads, rotary positions, then W^O.

    head_norm: makes the norm applied to each query and key head (of width head_dim) before rotation; None: none.
    """

    def __init__(
        self,
        config: GroupedAttentionConfig,
        *,
        scale: float,
        head_norm: Callable[[int], nn.Module] | None = None,
    ) -> None:
        super().__init__()
        d_model, num_heads, num_kv_heads, head_dim = (
            config.d_model,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        )
        bias = config.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.q_proj = nn.Linear(d_model, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(d_model, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(d_model, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, d_model, bias=bias)
        self.q_norm = head_norm(head_dim) if head_norm is not None else None
        self.k_norm = head_norm(head_dim) if head_norm is not None else None

    def _heads(self, states: Tensor, count: int, norm: nn.Module | None) -> Tensor:
        """[batch, seq, count · d_k] -> [batch, count, seq, d_k], each head normalised where the model does."""
        heads = states.view(states.shape[0], states.shape[1], count, self.head_dim)
        return (heads if norm is None else norm(heads)).transpose(1, 2)

    def _shared(self, states: Tensor) -> Tensor:
        """Key/value heads [batch, kv_heads, seq, d_k] repeated for their query heads [batch, heads, seq, d_k]."""
        batch, kv_heads, length, width = states.shape
        groups = self.num_heads // kv_heads
        return states[:, :, None].expand(batch, kv_heads, groups, length, width).reshape(batch, -1, length, width)

    def forward(self, hidden: Tensor, rotary: tuple[Tensor, Tensor], attention_bias: Tensor) -> Tensor:
        """Attend over hidden [batch, seq, d_model]; rotary is (cos, sin) [seq, d_k]; bias [batch, 1, seq|1, seq]."""
        query = rotate(self._heads(self.q_proj(hidden), self.num_heads, self.q_norm), *rotary)
        key = rotate(self._heads(self.k_proj(hidden), self.num_kv_heads, self.k_norm), *rotary)
        value = self._heads(self.v_proj(hidden), self.num_kv_heads, None)
        scores = torch.matmul(query, self._shared(key).transpose(-1, -2)) * self.scale
        weights = torch.softmax((scores + attention_bias).to(torch.float32), dim=-1).to(hidden.dtype)
        context = torch.matmul(weights, self._shared(value)).transpose(1, 2)
        return self.o_proj(context.reshape(hidden.shape[0], hidden.shape[1], -1))
