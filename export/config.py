"""The one object that describes an encoder's shape."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

Activation = Literal["gelu", "gelu_tanh", "relu"]
Pooling = Literal["mean", "cls"]
PositionEmbedding = Literal["learned", "sinusoidal"]


class ConfigError(ValueError):
    """An encoder configuration that cannot describe a working model."""


@dataclass(frozen=True)
class EncoderConfig:
    """Hyper-parameters of a BERT-style encoder, validated on construction."""

    vocab_size: int
    """Number of token ids."""
    d_model: int
    """Width of every hidden state."""
    num_heads: int
    """Attention heads per layer; each has d_k = d_model / num_heads."""
    num_layers: int
    """Encoder layers stacked (S)."""
    ffn_dim: int
    """Inner width of the position-wise feed-forward network."""
    max_positions: int = 512
    """Longest sequence the position embedding covers."""
    type_vocab_size: int = 2
    """Segment ids; 0 means the model has no segment embedding."""
    activation: Activation = "gelu"
    """Feed-forward activation."""
    layer_norm_eps: float = 1e-12
    """LayerNorm epsilon."""
    position_embedding: PositionEmbedding = "learned"
    """Learned position table (BERT) or fixed sinusoids (the original Transformer)."""
    pooling: Pooling = "mean"
    """Mean over the attention mask, or the first ([CLS]) token."""
    normalize: bool = True
    """L2-normalise the pooled embedding."""
    pad_token_id: int = 0
    """Id used to pad sequences."""

    def __post_init__(self) -> None:
        positive = ("vocab_size", "d_model", "num_heads", "num_layers", "ffn_dim", "max_positions")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.d_model % self.num_heads:
            raise ConfigError(f"d_model {self.d_model} is not divisible by num_heads {self.num_heads}")
        if self.type_vocab_size < 0:
            raise ConfigError(f"type_vocab_size must be >= 0, got {self.type_vocab_size}")
        if self.activation not in ("gelu", "gelu_tanh", "relu"):
            raise ConfigError(f"unsupported activation {self.activation!r}")
        if self.pooling not in ("mean", "cls"):
            raise ConfigError(f"unsupported pooling {self.pooling!r}")
        if self.position_embedding not in ("learned", "sinusoidal"):
            raise ConfigError(f"unsupported position embedding {self.position_embedding!r}")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ConfigError(f"pad_token_id {self.pad_token_id} is outside the vocabulary")

    @property
    def head_dim(self) -> int:
        """d_k: the width of one attention head."""
        return self.d_model // self.num_heads

    @property
    def uses_segments(self) -> bool:
        """Whether the model takes token_type_ids."""
        return self.type_vocab_size > 0

    def to_dict(self) -> dict[str, object]:
        """Plain-data form, for parity.json and the repository's parameters."""
        return dataclasses.asdict(self)
