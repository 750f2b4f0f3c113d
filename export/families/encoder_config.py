"""The configuration the families with their own encoder module share: its fields, their checks, their reading.

Each such family's configuration is a frozen, keyword-only dataclass deriving from EncoderConfigBase: it adds
its own fields (and redeclares a shared one to give it the family's default) and its own checks. Its
config.json reader takes the shared fields with read_shared_fields and an activation with read_activation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from export.checkpoints.architecture_error import ArchitectureError
from export.layers.pooling import POOLING_MODES

SIZES = ("vocab_size", "d_model", "num_heads", "num_layers", "ffn_dim", "max_positions")
"""The shared fields that must be positive integers."""
SIZE_KEYS: Mapping[str, str] = {
    "vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "num_heads": "num_attention_heads",
    "num_layers": "num_hidden_layers",
    "ffn_dim": "intermediate_size",
}
"""The shared sizes -> the config.json keys that give them, as transformers' BERT-style configurations name them."""


@dataclass(frozen=True, kw_only=True)
class EncoderConfigBase:
    """The fields every family's own encoder has, checked on construction, and what they answer alike."""

    vocab_size: int
    """Number of token ids."""
    d_model: int
    """Width of every hidden state."""
    num_heads: int
    """Attention heads per layer (the query heads, where key/value heads are grouped)."""
    num_layers: int
    """Layers stacked (S)."""
    ffn_dim: int
    """Inner width of the feed-forward network (of each of a gated one's two projections)."""
    max_positions: int
    """Longest sequence the model was made for."""
    pad_token_id: int = 0
    """Id used to pad sequences."""
    pooling: str = "mean"
    """How one vector is made per sequence (export.layers.pooling): mean, cls, max or lasttoken."""
    normalize: bool = True
    """L2-normalise the pooled embedding."""

    invalid: ClassVar[type[ValueError]] = ArchitectureError
    """What an impossible configuration raises."""

    def __post_init__(self) -> None:
        self.check_positive(SIZES)
        if self.pooling not in POOLING_MODES:
            raise self.invalid(f"unsupported pooling {self.pooling!r}")

    def check_positive(self, names: tuple[str, ...]) -> None:
        """`invalid` unless each of the fields `names` is a positive integer."""
        for name in names:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise self.invalid(f"{name} must be a positive integer, got {value!r}")

    def check_pad_token_id(self) -> None:
        """`invalid` unless pad_token_id is a token id (where the family's embedding pads with it)."""
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise self.invalid(f"pad_token_id {self.pad_token_id} is outside the vocabulary")

    @property
    def uses_segments(self) -> bool:
        """Whether the model takes token_type_ids (a single segment row needs no input; none without the field)."""
        return getattr(self, "type_vocab_size", 0) > 1

    @property
    def max_sequence_positions(self) -> int:
        """Longest sequence the model was made for."""
        return self.max_positions

    def to_dict(self) -> dict[str, object]:
        """Plain-data form, for parity.json and the repository's parameters."""
        return dataclasses.asdict(self)


def read_shared_fields(
    hf_config: Mapping[str, object], pooling: str, normalize: bool, size_keys: Mapping[str, str] = SIZE_KEYS
) -> dict[str, object]:
    """The shared fields config.json gives alike, or ArchitectureError naming the first size key it lacks.

    They are the sizes under size_keys, pad_token_id (0 unless an integer) and the pooling and normalisation
    asked for; max_positions is each family's to read (its default, and for some its key, differs).
    """
    for key in size_keys.values():
        if key not in hf_config:
            raise ArchitectureError(f"config.json lacks {key!r}")
    pad_token_id = hf_config.get("pad_token_id")
    return {field: hf_config[key] for field, key in size_keys.items()} | {
        "pad_token_id": pad_token_id if isinstance(pad_token_id, int) else 0,
        "pooling": pooling,
        "normalize": normalize,
    }


def read_activation(hf_config: Mapping[str, object], key: str, names: Mapping[str, str], default: str) -> str:
    """Our name (names' value) for config.json's activation under key; ArchitectureError naming the supported ones."""
    activation = hf_config.get(key, default)
    if activation not in names:
        raise ArchitectureError(f"unsupported {key} {activation!r} (supported: {', '.join(names)})")
    return names[activation]
