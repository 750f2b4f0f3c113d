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

import torch.nn.functional as F

from export.checkpoints.architecture_error import ArchitectureError
from export.families.encoder_config import read_activation
from export.families.family import Family, Format
from export.layers.decoder import SWIGLU_ACTIVATION, DecoderConfig, DecoderEncoder, decoder_weights, read_decoder_fields
from export.layers.rotary import rope_theta

HEAD_PREFIXES = ("dense.", "classifier.", "lm_head.")
"""Weights of the sequence-classification head (dense, classifier) or the masked-LM head, set apart."""


@dataclass(frozen=True, kw_only=True)
class EuroBertConfig(DecoderConfig):
    """Hyper-parameters of a EuroBERT encoder, validated on construction (rotary angles have no length limit)."""

    max_positions: int = 8192
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10_000.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rope_theta <= 0:
            raise ArchitectureError(f"rope_theta {self.rope_theta} must be > 0")
        self.check_pad_token_id()


def config_from_hf(hf_config: dict, pooling: str, normalize: bool) -> EuroBertConfig:
    """Translate a Hugging Face EuroBERT config.json (EuroBertModel, -ForMaskedLM, -ForSequenceClassification)."""
    fields = read_decoder_fields(EuroBertConfig, hf_config, pooling, normalize)
    read_activation(hf_config, "hidden_act", SWIGLU_ACTIVATION, "silu")
    if hf_config.get("mlp_bias"):
        raise ArchitectureError("unsupported mlp_bias true: only MLP projections without biases")
    return EuroBertConfig(**fields, rope_theta=rope_theta(hf_config))


rename_weights = decoder_weights(HEAD_PREFIXES)
"""EuroBERT's parameter names (bare, or under model. / 0.auto_model.) -> this module's; head weights apart."""


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
