"""What a model family is, as each family module declares it at its end (export.families.registry lists them).

A family is one encoder module and the config.json model types it reads: for each, how its config.json
translates into the family's configuration and how its weight names map onto the encoder's, and the
classifier head its sequence-classification models carry. It also says which of ONNX Runtime's
transformer fusions fit its graph (export.graph.forms).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from torch import Tensor, nn

BERT_FUSIONS = ("unfused", "attention_fused", "fully_fused")
"""Graph forms of a model ONNX Runtime's BERT fusions fit: the raw graph, fused attention, everything fused."""
UNFUSED = ("unfused",)
"""The graph form of a model those fusions do not fit (RMSNorm, rotary grouped-query attention)."""

Renamer = Callable[[dict[str, Tensor]], tuple[dict[str, Tensor], dict[str, Tensor]]]
"""A checkpoint's weights -> (the encoder's, under its names; the task heads', apart)."""


class EncoderSettings(Protocol):
    """What the exporter reads from any family's configuration."""

    vocab_size: int
    d_model: int
    num_heads: int
    num_layers: int
    pad_token_id: int
    pooling: str
    normalize: bool

    @property
    def head_dim(self) -> int:
        """d_k: the width of one attention head."""

    @property
    def uses_segments(self) -> bool:
        """Whether the model takes token_type_ids."""

    @property
    def max_sequence_positions(self) -> int:
        """Longest sequence the model was made for."""

    def to_dict(self) -> dict[str, object]:
        """Plain-data form, for parity.json."""


@dataclass(frozen=True)
class Format:
    """One config.json model_type a family reads."""

    model_type: str
    read_config: Callable[[dict, str, bool], EncoderSettings]
    """config.json (with pooling and normalisation) -> the family's configuration."""
    rename_weights: Renamer
    """The checkpoint's weights -> (the encoder's, under its names; the task heads', apart)."""
    classifier_style: str | None = None
    """The layout of its sequence-classification head (export.heads.classifier); None: none implemented."""
    read_adapters: Callable[[Path, EncoderSettings], tuple[EncoderSettings, dict[str, Tensor]]] | None = None
    """(folder, configuration) -> the configuration with its task adapters, and their weights; None: none read."""


@dataclass(frozen=True)
class Family:
    """A model family: its configuration type, its encoder, the model types it reads, the graph forms it fits."""

    name: str
    config_type: type
    """The family's configuration class (one family a class)."""
    build: Callable[[EncoderSettings], nn.Module]
    """Configuration -> the encoder, randomly initialised."""
    formats: tuple[Format, ...]
    graph_forms: tuple[str, ...] = UNFUSED
    """The CPU candidate graph forms (BERT_FUSIONS where ONNX Runtime's BERT fusions fit the graph)."""
    towers: tuple[str, ...] = ()
    """What a two-tower model's towers take ("image", "text"), each tower its own graph; empty: one encoder graph."""

    @property
    def fp16_form(self) -> str:
        """The graph form converted to fp16 for CUDA: the fully fused one where it fits, else the unfused one."""
        return "fully_fused" if "fully_fused" in self.graph_forms else "unfused"
