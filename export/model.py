"""A BERT-style transformer encoder, written out from its definition.

Embeddings (token + position + segment, then LayerNorm) feed S post-norm layers, each
multi-head self-attention and a position-wise feed-forward network wrapped in residual
Add & LayerNorm; the last hidden state is pooled (mean over the mask, or CLS) and optionally
L2-normalised. Attention is plain matmul/softmax so that ONNX Runtime's optimiser can
recognise and fuse it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from export.config import EncoderConfig


def sinusoidal_positions(max_positions: int, d_model: int) -> Tensor:
    """The fixed sin/cos position table of "Attention Is All You Need" (d_model may be odd)."""
    positions = torch.arange(max_positions, dtype=torch.float32).unsqueeze(1)
    frequencies = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    table = torch.zeros(max_positions, d_model)
    table[:, 0::2] = torch.sin(positions * frequencies)
    table[:, 1::2] = torch.cos(positions * frequencies[: d_model // 2])
    return table


class Embeddings(nn.Module):
    """Token + position (+ segment) embeddings followed by LayerNorm."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.token = nn.Embedding(config.vocab_size, config.d_model, padding_idx=config.pad_token_id)
        self.position = nn.Embedding(config.max_positions, config.d_model)
        if config.position_embedding == "sinusoidal":
            self.position.weight.data.copy_(sinusoidal_positions(config.max_positions, config.d_model))
            self.position.weight.requires_grad_(False)
        self.segment = nn.Embedding(config.type_vocab_size, config.d_model) if config.uses_segments else None
        self.norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.register_buffer("position_ids", torch.arange(config.max_positions).unsqueeze(0), persistent=False)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None) -> Tensor:
        """Embed ids [batch, seq] into hidden states [batch, seq, d_model]."""
        seq_len = input_ids.shape[1]
        hidden = self.token(input_ids) + self.position(self.position_ids[:, :seq_len])
        if self.segment is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(input_ids)
            hidden = hidden + self.segment(token_type_ids)
        return self.norm(hidden)


class MultiHeadAttention(nn.Module):
    """Self-attention: Q, K, V projections split into heads, softmax(QKᵀ/√d_k + mask)·V, then W^O."""

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.query = nn.Linear(d_model, d_model)
        self.key = nn.Linear(d_model, d_model)
        self.value = nn.Linear(d_model, d_model)
        self.output = nn.Linear(d_model, d_model)

    def _split_heads(self, projected: Tensor) -> Tensor:
        """[batch, seq, d_model] -> [batch, heads, seq, d_k]."""
        # Size arithmetic as BERT writes it: the traced Shape/Concat pattern the ORT optimiser fuses.
        shape = projected.size()[:-1] + (self.num_heads, self.head_dim)  # noqa: RUF005
        return projected.view(shape).permute(0, 2, 1, 3)

    def forward(self, hidden: Tensor, attention_bias: Tensor) -> Tensor:
        """Attend; attention_bias is [batch, 1, 1, seq], 0 where attended and very negative at padding."""
        query = self._split_heads(self.query(hidden))
        key = self._split_heads(self.key(hidden))
        value = self._split_heads(self.value(hidden))
        scores = torch.matmul(query, key.transpose(-1, -2)) / math.sqrt(self.head_dim)
        weights = torch.softmax(scores + attention_bias, dim=-1)
        context = torch.matmul(weights, value).permute(0, 2, 1, 3).contiguous()
        concatenated = context.view(context.size()[:-2] + (self.num_heads * self.head_dim,))  # noqa: RUF005
        return self.output(concatenated)


class FeedForward(nn.Module):
    """Position-wise feed-forward network: Linear, activation, Linear."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.inner = nn.Linear(config.d_model, config.ffn_dim)
        self.outer = nn.Linear(config.ffn_dim, config.d_model)
        self.activation = config.activation

    def forward(self, hidden: Tensor) -> Tensor:
        """Apply the network to every position independently."""
        inner = self.inner(hidden)
        if self.activation == "relu":
            inner = F.relu(inner)
        else:
            inner = F.gelu(inner, approximate="tanh" if self.activation == "gelu_tanh" else "none")
        return self.outer(inner)


class EncoderLayer(nn.Module):
    """One post-norm layer: x = LN(x + Attention(x)); x = LN(x + FFN(x))."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.attention = MultiHeadAttention(config.d_model, config.num_heads)
        self.attention_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.feed_forward = FeedForward(config)
        self.output_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)

    def forward(self, hidden: Tensor, attention_bias: Tensor) -> Tensor:
        """Transform hidden states [batch, seq, d_model]."""
        hidden = self.attention_norm(hidden + self.attention(hidden, attention_bias))
        return self.output_norm(hidden + self.feed_forward(hidden))


class Encoder(nn.Module):
    """The whole encoder: embeddings, S layers, pooling and optional normalisation."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_layers))

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Return (last_hidden_state [batch, seq, d_model], embedding [batch, d_model])."""
        hidden = self.embeddings(input_ids, token_type_ids)
        mask = attention_mask.to(hidden.dtype)
        attention_bias = (1.0 - mask[:, None, None, :]) * torch.finfo(hidden.dtype).min
        for layer in self.layers:
            hidden = layer(hidden, attention_bias)
        return hidden, self.pool(hidden, mask)

    def pool(self, hidden: Tensor, mask: Tensor) -> Tensor:
        """Pool hidden states into one vector per sequence (mask is float [batch, seq])."""
        if self.config.pooling == "cls":
            pooled = hidden[:, 0]
        else:
            weights = mask.unsqueeze(-1)
            pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
        if self.config.normalize:
            pooled = F.normalize(pooled, p=2.0, dim=1)
        return pooled
