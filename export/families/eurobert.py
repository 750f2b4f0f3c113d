"""EuroBERT from its definition: a Llama-style encoder that attends in both directions.

Token embeddings (no position table, no segments, no LayerNorm) feed S pre-norm layers:
x = x + Attention(RMSNorm(x)); x = x + MLP(RMSNorm(x)), then a final RMSNorm. RMSNorm and the
SwiGLU MLP, W_down(silu(x·W_gate) ⊙ x·W_up), are Qwen3's (export.families.qwen3). Attention is grouped-query:
H query heads share K key/value heads (query head h reads key/value head h // (H / K)), each head
d_k wide; queries and keys are turned by rotary angles (export.layers.rotary, base rope_theta) of positions
0..n-1, and every token attends to every token the padding mask keeps (no causal mask, no q/k norm).
The last hidden state is pooled (export.layers.pooling) as for every encoder here; a classifier's head
(export.heads.classifier, style "eurobert") reads it too.

Positions count from the first column whatever the padding: rotary scores depend on the distance
between two tokens only, so a left-padded row gives the same states as right-padded
(tests/export/test_eurobert.py measures both against transformers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from export.checkpoints.architecture_error import ArchitectureError
from export.checkpoints.weight_names import split_weights
from export.families.config_facts import OwnEncoderFacts
from export.families.qwen3 import MLP, RMSNorm
from export.layers.grouped_attention import GroupedQueryAttention
from export.layers.pooling import pool
from export.layers.rotary import RotaryTable, rope_theta

HEAD_PREFIXES = ("dense.", "classifier.", "lm_head.")
"""Weights of the sequence-classification head (dense, classifier) or the masked-LM head, set apart."""
_WRAPPERS = ("model.", "0.auto_model.")
_ENCODER_PREFIXES = ("embed_tokens.", "layers.", "norm.")


@dataclass(frozen=True)
class EuroBertConfig(OwnEncoderFacts):
    """Hyper-parameters of a EuroBERT encoder, validated on construction."""

    vocab_size: int
    d_model: int
    num_heads: int
    """Query heads per layer."""
    num_kv_heads: int
    """Key/value heads per layer, each shared by num_heads // num_kv_heads query heads."""
    head_dim: int
    """d_k: the width of one attention head."""
    num_layers: int
    ffn_dim: int
    """Width of the SwiGLU MLP's gate and up projections."""
    max_positions: int = 8192
    """Longest sequence the model was made for (rotary angles themselves have no limit)."""
    pad_token_id: int = 0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10_000.0
    attention_bias: bool = False
    """Whether the Q, K, V and output projections carry a bias."""
    pooling: str = "mean"
    normalize: bool = True

    def __post_init__(self) -> None:
        self.check_sizes_and_pooling(
            ("vocab_size", "d_model", "num_heads", "num_kv_heads", "head_dim", "num_layers", "ffn_dim", "max_positions")
        )
        if self.num_heads % self.num_kv_heads:
            raise ArchitectureError(
                f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ArchitectureError(f"head_dim {self.head_dim} must be even (rotary angles turn pairs)")
        if self.rope_theta <= 0:
            raise ArchitectureError(f"rope_theta {self.rope_theta} must be > 0")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ArchitectureError(f"pad_token_id {self.pad_token_id} is outside the vocabulary")


def config_from_hf(hf_config: dict, pooling: str, normalize: bool) -> EuroBertConfig:
    """Translate a Hugging Face EuroBERT config.json (EuroBertModel, -ForMaskedLM, -ForSequenceClassification)."""
    for key in ("vocab_size", "hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size"):
        if key not in hf_config:
            raise ArchitectureError(f"config.json lacks {key!r}")
    activation = hf_config.get("hidden_act", "silu")
    if activation != "silu":
        raise ArchitectureError(f"unsupported hidden_act {activation!r} (supported: silu)")
    if hf_config.get("mlp_bias"):
        raise ArchitectureError("unsupported mlp_bias true: only MLP projections without biases")
    heads = hf_config["num_attention_heads"]
    pad_token_id = hf_config.get("pad_token_id")
    return EuroBertConfig(
        vocab_size=hf_config["vocab_size"],
        d_model=hf_config["hidden_size"],
        num_heads=heads,
        num_kv_heads=hf_config.get("num_key_value_heads") or heads,
        head_dim=hf_config.get("head_dim") or hf_config["hidden_size"] // heads,
        num_layers=hf_config["num_hidden_layers"],
        ffn_dim=hf_config["intermediate_size"],
        max_positions=hf_config.get("max_position_embeddings", 8192),
        pad_token_id=pad_token_id if isinstance(pad_token_id, int) else 0,
        rms_norm_eps=hf_config.get("rms_norm_eps", 1e-5),
        rope_theta=rope_theta(hf_config),
        attention_bias=bool(hf_config.get("attention_bias", False)),
        pooling=pooling,
        normalize=normalize,
    )


def rename_weights(weights: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """EuroBERT's parameter names (bare, or under model. / 0.auto_model.) -> this module's; head weights apart."""
    return split_weights(weights, _WRAPPERS, _ENCODER_PREFIXES, HEAD_PREFIXES)


class Layer(nn.Module):
    """One pre-norm layer: x = x + Attention(RMSNorm(x)); x = x + MLP(RMSNorm(x))."""

    def __init__(self, config: EuroBertConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.d_model, config.rms_norm_eps)
        self.self_attn = GroupedQueryAttention(
            config,
            scale=config.head_dim**-0.5,
        )
        self.post_attention_layernorm = RMSNorm(config.d_model, config.rms_norm_eps)
        self.mlp = MLP(config)  # Qwen3's SwiGLU reads d_model and ffn_dim only

    def forward(self, hidden: Tensor, rotary: tuple[Tensor, Tensor], attention_bias: Tensor) -> Tensor:
        """Transform hidden states [batch, seq, d_model]."""
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rotary, attention_bias)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class EuroBertEncoder(nn.Module):
    """The whole encoder: token embeddings, S bidirectional layers, final RMSNorm, pooling."""

    output_names = ("last_hidden_state", "embedding")

    def __init__(self, config: EuroBertConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.d_model, config.rms_norm_eps)
        self.rotary = RotaryTable(config.head_dim, config.rope_theta, config.max_positions)

    def hidden_states(
        self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """The last hidden states [batch, seq, d_model] and the float mask [batch, seq] (task heads start here)."""
        hidden = self.embed_tokens(input_ids)
        mask = attention_mask.to(hidden.dtype)
        keys = attention_mask[:, None, None, :].bool()  # [batch, 1, 1, seq]
        zero = torch.zeros((), dtype=hidden.dtype, device=hidden.device)
        attention_bias = torch.where(keys, zero, torch.finfo(hidden.dtype).min)
        rotary = self.rotary(input_ids.shape[1], hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, rotary, attention_bias)
        return self.norm(hidden), mask

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Return (last_hidden_state [batch, seq, d_model], embedding [batch, d_model])."""
        hidden, mask = self.hidden_states(input_ids, attention_mask)
        return hidden, pool(hidden, mask, self.config.pooling, self.config.normalize)
