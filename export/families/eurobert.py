"""EuroBERT from its definition: a Llama-style encoder that attends in both directions.

Token embeddings (no position table, no segments, no LayerNorm) feed S pre-norm layers: x = x +
Attention(RMSNorm(x)); x = x + MLP(RMSNorm(x)), then a final RMSNorm. RMSNorm, the SwiGLU MLP,
W_down(silu(x·W_gate) ⊙ x·W_up), and the layer are the shared decoder block's (export.layers.decoder).
Attention is grouped-query: H query heads share K key/value heads (query head h reads key/value head h
// (H / K)), each head d_k wide; queries and keys are turned by rotary angles (export.layers.rotary,
base rope_theta) of positions 0..n-1, and every token attends to every token the padding mask keeps (no
causal mask, no q/k norm). The last hidden state is pooled (export.layers.pooling) as for every encoder
here; a classifier's head (export.heads.classifier, style "eurobert") reads it too.

Positions count from the first column whatever the padding: rotary scores depend on the distance between
two tokens only, so a left-padded row gives the same states as right-padded
(tests/export/test_eurobert.py measures both against transformers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch.nn.functional as F
from torch import Tensor

from export.checkpoints.architecture_error import ArchitectureError
from export.families.family import Family, Format
from export.layers.decoder import (
    DecoderConfig,
    DecoderEncoder,
    check_activation,
    read_config,
    require_keys,
    split_decoder_weights,
)
from export.layers.rotary import rope_theta

HEAD_PREFIXES = ("dense.", "classifier.", "lm_head.")
"""Weights of the sequence-classification head (dense, classifier) or the masked-LM head, set apart."""


@dataclass(frozen=True)
class EuroBertConfig(DecoderConfig):
    """Hyper-parameters of a EuroBERT encoder, validated on construction."""

    max_positions: int = 8192
    """Longest sequence the model was made for (rotary angles themselves have no limit)."""
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10_000.0

    OTHER_SIZES: ClassVar[tuple[str, ...]] = ("max_positions",)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rope_theta <= 0:
            raise ArchitectureError(f"rope_theta {self.rope_theta} must be > 0")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ArchitectureError(f"pad_token_id {self.pad_token_id} is outside the vocabulary")


def config_from_hf(hf_config: dict, pooling: str, normalize: bool) -> EuroBertConfig:
    """Translate a Hugging Face EuroBERT config.json (EuroBertModel, -ForMaskedLM, -ForSequenceClassification)."""
    require_keys(hf_config)
    check_activation(hf_config, "hidden_act", ("silu",), "silu")
    if hf_config.get("mlp_bias"):
        raise ArchitectureError("unsupported mlp_bias true: only MLP projections without biases")
    return read_config(EuroBertConfig, hf_config, pooling, normalize, rope_theta=rope_theta(hf_config))


def rename_weights(weights: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """EuroBERT's parameter names (bare, or under model. / 0.auto_model.) -> this module's; head weights apart."""
    return split_decoder_weights(weights, HEAD_PREFIXES)


class EuroBertEncoder(DecoderEncoder):
    """The whole encoder: token embeddings, S bidirectional layers, final RMSNorm, pooling."""

    def __init__(self, config: EuroBertConfig) -> None:
        super().__init__(config, activation=F.silu, scale=config.head_dim**-0.5, head_norm=False)


FAMILY = Family(
    name="eurobert",
    config_type=EuroBertConfig,
    build=EuroBertEncoder,
    formats=(Format("eurobert", config_from_hf, rename_weights, "eurobert"),),
)
"""EuroBERT."""
