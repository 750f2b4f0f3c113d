"""The objects that describe an encoder's shape.

The BERT family's EncoderConfig, and what the other families' configurations (ModernBERT, DeBERTa,
GTE/NomicBERT, Qwen3) share.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from export.checkpoints.architecture_error import ArchitectureError
from export.layers.pooling import POOLING_MODES, Pooling
from export.sources import UnusableSource

Activation = Literal["gelu", "gelu_tanh", "relu"]
PositionEmbedding = Literal["learned", "sinusoidal"]
PositionIds = Literal["sequential", "after_padding"]


class ConfigError(UnusableSource):
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
    """Segment ids; 0: no segment embedding; 1: one segment row added to every token (RoBERTa), no input."""
    activation: Activation = "gelu"
    """Feed-forward activation."""
    layer_norm_eps: float = 1e-12
    """LayerNorm epsilon."""
    position_embedding: PositionEmbedding = "learned"
    """Learned position table (BERT) or fixed sinusoids (the original Transformer)."""
    position_ids: PositionIds = "sequential"
    """sequential: position i is slot i (BERT); after_padding: non-padding tokens count from pad_token_id + 1
    and padding sits at pad_token_id (RoBERTa, XLM-R, MPNet)."""
    relative_attention_buckets: int = 0
    """Buckets of a relative position bias shared by every layer (MPNet); 0: none."""
    relative_attention_max_distance: int = 128
    """Distance from which relative positions share the last (logarithmic) bucket."""
    pooling: Pooling = "mean"
    """How one vector is made per sequence (export.layers.pooling): mean, cls, max or lasttoken."""
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
        if self.pooling not in POOLING_MODES:
            raise ConfigError(f"unsupported pooling {self.pooling!r}")
        if self.position_embedding not in ("learned", "sinusoidal"):
            raise ConfigError(f"unsupported position embedding {self.position_embedding!r}")
        if self.position_ids not in ("sequential", "after_padding"):
            raise ConfigError(f"unsupported position ids {self.position_ids!r}")
        if self.position_ids == "after_padding" and self.max_sequence_positions <= 0:
            raise ConfigError(f"max_positions {self.max_positions} leaves no position after pad_token_id")
        if self.relative_attention_buckets < 0 or self.relative_attention_max_distance <= 0:
            raise ConfigError("relative attention buckets must be >= 0 and their max distance positive")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ConfigError(f"pad_token_id {self.pad_token_id} is outside the vocabulary")

    @property
    def head_dim(self) -> int:
        """d_k: the width of one attention head."""
        return self.d_model // self.num_heads

    @property
    def uses_segments(self) -> bool:
        """Whether the model takes token_type_ids (a single segment row needs no input)."""
        return self.type_vocab_size > 1

    @property
    def max_sequence_positions(self) -> int:
        """Longest sequence the positions cover (RoBERTa-style ids start after pad_token_id)."""
        if self.position_ids == "after_padding":
            return self.max_positions - self.pad_token_id - 1
        return self.max_positions

    def to_dict(self) -> dict[str, object]:
        """Plain-data form, for parity.json and the repository's parameters."""
        return dataclasses.asdict(self)


class OwnEncoderFacts:
    """What the configurations of the families with their own encoder module answer alike.

    A mixin for their frozen dataclasses: segments as type_vocab_size says (none when the family has
    no such field), the longest sequence as max_positions, the plain-data form, and the checks every
    one of them makes.
    """

    max_positions: int
    pooling: str

    @property
    def uses_segments(self) -> bool:
        """Whether the model takes token_type_ids (a single segment row needs no input)."""
        return getattr(self, "type_vocab_size", 0) > 1

    @property
    def max_sequence_positions(self) -> int:
        """Longest sequence the model was made for."""
        return self.max_positions

    def to_dict(self) -> dict[str, object]:
        """Plain-data form, for parity.json."""
        return dataclasses.asdict(self)

    def check_sizes_and_pooling(self, positive: tuple[str, ...]) -> None:
        """ArchitectureError unless each of `positive` is a positive integer and the pooling is one we have."""
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ArchitectureError(f"{name} must be a positive integer, got {value!r}")
        if self.pooling not in POOLING_MODES:
            raise ArchitectureError(f"unsupported pooling {self.pooling!r}")
