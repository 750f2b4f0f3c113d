"""A BERT-style transformer encoder, written out from its definition.

Embeddings (token + position + segment, then LayerNorm) feed S post-norm layers, each
multi-head self-attention and a position-wise feed-forward network wrapped in residual
Add & LayerNorm; the last hidden state is pooled (export.layers.pooling) and optionally L2-normalised.
Attention is plain matmul/softmax so that ONNX Runtime's optimiser can recognise and fuse it.

The BERT family differs only in configuration: RoBERTa and XLM-R count positions after the
padding id and add their single segment row to every token; DistilBERT has no segments; MPNet
also adds a relative position bias, shared by every layer, to the attention scores.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from export.families.config_facts import EncoderConfig
from export.layers.pooling import pool


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
        self.segment = nn.Embedding(config.type_vocab_size, config.d_model) if config.type_vocab_size else None
        self.norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.pad_token_id = config.pad_token_id
        self.positions_after_padding = config.position_ids == "after_padding"
        self.register_buffer("position_ids", torch.arange(config.max_positions).unsqueeze(0), persistent=False)

    def positions(self, input_ids: Tensor) -> Tensor:
        """Position ids [batch or 1, seq]: slots in order, or (after_padding) counted over non-padding ids."""
        if not self.positions_after_padding:
            return self.position_ids[:, : input_ids.shape[1]]
        real = input_ids.ne(self.pad_token_id).to(torch.int64)
        return torch.cumsum(real, dim=1) * real + self.pad_token_id

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None) -> Tensor:
        """Embed ids [batch, seq] into hidden states [batch, seq, d_model]."""
        hidden = self.token(input_ids) + self.position(self.positions(input_ids))
        if self.segment is not None:
            if self.segment.num_embeddings == 1:
                hidden = hidden + self.segment.weight[0]
            else:
                if token_type_ids is None:
                    token_type_ids = torch.zeros_like(input_ids)
                hidden = hidden + self.segment(token_type_ids)
        return self.norm(hidden)


def relative_position_buckets(length: int, num_buckets: int, max_distance: int, device: torch.device) -> Tensor:
    """[length, length] bucket of each key position relative to each query position (T5's, as MPNet uses it).

    Half the buckets are for keys before the query, half after; within each half, the first
    half are exact distances and the rest grow logarithmically up to max_distance.
    """
    positions = torch.arange(length, dtype=torch.int64, device=device)
    distance = positions[:, None] - positions[None, :]  # query - key
    half = num_buckets // 2
    buckets = (distance < 0).to(torch.int64) * half
    distance = distance.abs()
    exact = half // 2
    logarithmic = exact + (torch.log(distance.float() / exact) / math.log(max_distance / exact) * (half - exact)).to(
        torch.int64
    )
    logarithmic = torch.clamp(logarithmic, max=half - 1)
    return buckets + torch.where(distance < exact, distance, logarithmic)


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
        """Attend, adding attention_bias to the scores.

        attention_bias is [batch, 1, 1, seq] (0 where attended, very negative at padding), or
        [batch, heads, seq, seq] with a relative position bias.
        """
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

    output_names = ("last_hidden_state", "embedding")

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_layers))
        buckets = config.relative_attention_buckets
        self.relative_attention_bias = nn.Embedding(buckets, config.num_heads) if buckets else None

    def hidden_states(
        self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """The last hidden states [batch, seq, d_model] and the float mask [batch, seq] (task heads start here)."""
        hidden = self.embeddings(input_ids, token_type_ids)
        mask = attention_mask.to(hidden.dtype)
        attention_bias = (1.0 - mask[:, None, None, :]) * torch.finfo(hidden.dtype).min
        if self.relative_attention_bias is not None:
            buckets = relative_position_buckets(
                input_ids.shape[1],
                self.config.relative_attention_buckets,
                self.config.relative_attention_max_distance,
                input_ids.device,
            )
            attention_bias = attention_bias + self.relative_attention_bias(buckets).permute(2, 0, 1).unsqueeze(0)
        for layer in self.layers:
            hidden = layer(hidden, attention_bias)
        return hidden, mask

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Return (last_hidden_state [batch, seq, d_model], embedding [batch, d_model])."""
        hidden, mask = self.hidden_states(input_ids, attention_mask, token_type_ids)
        return hidden, pool(hidden, mask, self.config.pooling, self.config.normalize)
