"""The pre-norm decoder-shaped encoder shared by Qwen3, EuroBERT and Gemma, from its definition.

Token embeddings feed S layers: x = x + Attention(N(x)); x = x + MLP(N(x)) (Gemma: each block's output
normalised too, "sandwich"), then a final norm. N is RMSNorm, w ⊙ x / √(mean(x²) + ε) computed in fp32
(Gemma brings its own (1 + w) form). Attention is grouped-query with rotary angles
(export.layers.grouped_attention); the MLP is gated: W_down(act(x·W_gate) ⊙ x·W_up), SwiGLU with SiLU.
A family says what each layer attends to (causal, bidirectional, a window) and with which rotary table;
the last hidden state is pooled (export.layers.pooling) as for every encoder here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from export.checkpoints.architecture_error import ArchitectureError
from export.checkpoints.weight_names import split_weights
from export.families.encoder_config import EncoderConfigBase, read_shared_fields
from export.families.family import Renamer
from export.layers.grouped_attention import GroupedQueryAttention
from export.layers.pooling import PooledEncoder
from export.layers.rotary import RotaryTable

WRAPPERS = ("model.", "0.auto_model.")
"""Prefixes that wrap the decoder inside task models and sentence-transformers modules."""
BODY_PREFIXES = ("embed_tokens.", "layers.", "norm.")
"""The decoder's own weights, as transformers names Qwen3's, Gemma3's and EuroBERT's."""
SWIGLU_ACTIVATION = {"silu": "silu"}
"""config.json's hidden_act of a SwiGLU MLP (Qwen3's, EuroBERT's): the one activation it is built with."""

Rotary = tuple[Tensor, Tensor]
"""(cos, sin) [seq, head_dim] of a layer's rotary angles."""


@dataclass(frozen=True, kw_only=True)
class DecoderConfig(EncoderConfigBase):
    """Hyper-parameters of a decoder-shaped encoder, validated on construction (each family sets its defaults)."""

    num_kv_heads: int
    """Key/value heads per layer, each shared by num_heads // num_kv_heads query heads."""
    head_dim: int
    """d_k: the width of one attention head."""
    max_positions: int = 32768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    attention_bias: bool = False
    """Whether the Q, K, V and output projections carry a bias."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_positive(("num_kv_heads", "head_dim"))
        if self.num_heads % self.num_kv_heads:
            raise ArchitectureError(
                f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ArchitectureError(f"head_dim {self.head_dim} must be even (rotary angles turn pairs)")


def read_decoder_fields(
    config_type: type[DecoderConfig], hf_config: dict, pooling: str, normalize: bool
) -> dict[str, object]:
    """config.json's decoder keys as config_type's fields (its defaults where config.json says nothing).

    ArchitectureError naming the first size key config.json lacks; the family adds its own fields (and its
    rope_theta, read as the family reads it).
    """
    shared = read_shared_fields(hf_config, pooling, normalize)
    defaults = config_type.__dataclass_fields__
    heads = hf_config["num_attention_heads"]
    return shared | {
        "num_kv_heads": hf_config.get("num_key_value_heads") or heads,
        "head_dim": hf_config.get("head_dim") or hf_config["hidden_size"] // heads,
        "max_positions": hf_config.get("max_position_embeddings", defaults["max_positions"].default),
        "rms_norm_eps": hf_config.get("rms_norm_eps", defaults["rms_norm_eps"].default),
        "attention_bias": bool(hf_config.get("attention_bias", False)),
    }


def decoder_weights(head_prefixes: tuple[str, ...]) -> Renamer:
    """A decoder checkpoint's renamer: its weights, bare or wrapped, names kept; a head's (head_prefixes) apart."""
    return functools.partial(split_weights, wrappers=WRAPPERS, body=BODY_PREFIXES, heads=head_prefixes)


class RMSNorm(nn.Module):
    """w ⊙ x / √(mean(x²) + ε) over the last axis, computed in fp32."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def normalised(self, hidden: Tensor) -> Tensor:
        """The root-mean-square normalised hidden [..., width]: x / √(mean(x²) + ε), in fp32."""
        values = hidden.to(torch.float32)
        return values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, hidden: Tensor) -> Tensor:
        """Normalise hidden [..., width]."""
        return self.weight * self.normalised(hidden).to(hidden.dtype)


class GatedMLP(nn.Module):
    """W_down(act(x·W_gate) ⊙ x·W_up)."""

    def __init__(self, config: DecoderConfig, activation: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.d_model, config.ffn_dim, bias=False)
        self.up_proj = nn.Linear(config.d_model, config.ffn_dim, bias=False)
        self.down_proj = nn.Linear(config.ffn_dim, config.d_model, bias=False)
        self.activation = activation

    def forward(self, hidden: Tensor) -> Tensor:
        """Apply the network to every position independently."""
        return self.down_proj(self.activation(self.gate_proj(hidden)) * self.up_proj(hidden))


Norm = Callable[[int, float], nn.Module]
"""(width, eps) -> an RMSNorm (RMSNorm, or Gemma's own)."""


class DecoderLayer(nn.Module):
    """One pre-norm layer: x = x + Attention(N(x)); x = x + MLP(N(x)); sandwich: each block's output normalised."""

    def __init__(
        self,
        config: DecoderConfig,
        *,
        norm: Norm,
        activation: Callable[[Tensor], Tensor],
        scale: float,
        head_norm: bool,
        sandwich: bool,
    ) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = norm(config.d_model, eps)
        self.self_attn = GroupedQueryAttention(
            config, scale=scale, head_norm=(lambda width: norm(width, eps)) if head_norm else None
        )
        self.post_attention_layernorm = norm(config.d_model, eps)
        self.sandwich = sandwich
        if sandwich:
            self.pre_feedforward_layernorm = norm(config.d_model, eps)
        self.mlp = GatedMLP(config, activation)
        if sandwich:
            self.post_feedforward_layernorm = norm(config.d_model, eps)

    def forward(self, hidden: Tensor, rotary: Rotary, attention_bias: Tensor) -> Tensor:
        """Transform hidden states [batch, seq, d_model]."""
        attended = self.self_attn(self.input_layernorm(hidden), rotary, attention_bias)
        if not self.sandwich:
            hidden = hidden + attended
            return hidden + self.mlp(self.post_attention_layernorm(hidden))
        hidden = hidden + self.post_attention_layernorm(attended)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


def attention_bias(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """The additive bias: 0 where a query may read a key (allowed), the dtype's minimum elsewhere."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


class DecoderEncoder(PooledEncoder):
    """Embeddings, S decoder layers, final norm, pooling; a family says what each layer attends to.

    By default every layer reads every token the mask keeps, with one rotary table (base rope_theta).
    """

    def __init__(
        self,
        config: DecoderConfig,
        *,
        activation: Callable[[Tensor], Tensor],
        scale: float,
        head_norm: bool,
        norm: Norm = RMSNorm,
        sandwich: bool = False,
        rotary: nn.Module | None = None,
    ) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(
            DecoderLayer(config, norm=norm, activation=activation, scale=scale, head_norm=head_norm, sandwich=sandwich)
            for _ in range(config.num_layers)
        )
        self.norm = norm(config.d_model, config.rms_norm_eps)
        self.rotary = rotary or RotaryTable(config.head_dim, config.rope_theta, config.max_positions)

    def embed(self, input_ids: Tensor) -> Tensor:
        """The token embeddings [batch, seq, d_model]."""
        return self.embed_tokens(input_ids)

    def reach(self, attention_mask: Tensor) -> Tensor:
        """Where a query may read a key [batch, 1, seq|1, seq]: every token the mask keeps (both directions)."""
        return attention_mask[:, None, None, :].bool()

    def layer_inputs(self, attention_mask: Tensor, dtype: torch.dtype) -> Sequence[tuple[Rotary, Tensor]]:
        """Each layer's rotary angles and attention bias [batch, 1, seq|1, seq]: the same for every layer."""
        bias = attention_bias(self.reach(attention_mask), dtype)
        return [(self.rotary(attention_mask.shape[1], dtype), bias)] * self.config.num_layers

    def hidden_states(
        self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """The last hidden states [batch, seq, d_model] and the float mask [batch, seq] (task heads start here)."""
        hidden = self.embed(input_ids)
        mask = attention_mask.to(hidden.dtype)
        for layer, (rotary, bias) in zip(self.layers, self.layer_inputs(attention_mask, hidden.dtype), strict=True):
            hidden = layer(hidden, rotary, bias)
        return self.norm(hidden), mask
