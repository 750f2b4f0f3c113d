"""Qwen3 as an embedder (Qwen3-Embedding) from its definition: a causal decoder read at each text's last token.

Token embeddings feed S pre-norm layers: x = x + Attention(RMSNorm(x)); x = x + MLP(RMSNorm(x)),
then a final RMSNorm. RMSNorm(x) = w ⊙ x / √(mean(x²) + ε). Attention is grouped-query: H query
heads share K key/value heads (query head h reads key/value head h // (H / K)), each head d_k wide
(head_dim, not necessarily d_model / H). Every query and key head is RMS-normalised over its d_k
(q_norm, k_norm) before rotary angles (base rope_theta; cos and sin tabled in fp32, export.layers.rotary) turn
it. A token attends to itself and to the earlier tokens that the padding mask keeps (causal). The MLP
is SwiGLU: W_down(silu(x·W_gate) ⊙ x·W_up). Pooling (export.layers.pooling) takes the last attended token
("lasttoken").

The server pads on the right; sentence-transformers pads Qwen3-Embedding on the left. Causal
attention never lets a real token see padding that comes after it, and rotary angles make a score
depend on the distance between two tokens only, so a text's last-token state is the same either
way (tests/export/test_qwen3.py measures it against transformers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from export.checkpoints.architecture_error import ArchitectureError
from export.checkpoints.weight_names import split_weights
from export.families.config_facts import OwnEncoderFacts
from export.layers.grouped_attention import GroupedQueryAttention
from export.layers.pooling import pool
from export.layers.rotary import RotaryTable, rope_theta

HEAD_PREFIXES = ("lm_head.", "score.")
"""Weights of a causal-LM or classification head, set apart from the decoder's."""
_WRAPPERS = ("model.", "0.auto_model.")
_DECODER_PREFIXES = ("embed_tokens.", "layers.", "norm.")


@dataclass(frozen=True)
class Qwen3Config(OwnEncoderFacts):
    """Hyper-parameters of a Qwen3 decoder used as an embedder, validated on construction."""

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
    max_positions: int = 32768
    pad_token_id: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    attention_bias: bool = False
    pooling: str = "lasttoken"
    normalize: bool = True

    def __post_init__(self) -> None:
        self.check_sizes_and_pooling(
            ("vocab_size", "d_model", "num_heads", "num_kv_heads", "head_dim", "num_layers", "ffn_dim")
        )
        if self.num_heads % self.num_kv_heads:
            raise ArchitectureError(
                f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ArchitectureError(f"head_dim {self.head_dim} must be even (rotary angles turn pairs)")


def config_from_hf(hf_config: dict, pooling: str, normalize: bool) -> Qwen3Config:
    """Translate a Hugging Face Qwen3 config.json (Qwen3Model / Qwen3ForCausalLM)."""
    for key in ("vocab_size", "hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size"):
        if key not in hf_config:
            raise ArchitectureError(f"config.json lacks {key!r}")
    if hf_config.get("use_sliding_window"):
        raise ArchitectureError("unsupported use_sliding_window true (sliding-window attention): only full attention")
    layer_types = hf_config.get("layer_types") or []
    if any(kind != "full_attention" for kind in layer_types):
        unsupported = next(kind for kind in layer_types if kind != "full_attention")
        raise ArchitectureError(f"unsupported layer_types {unsupported!r}: only full_attention")
    activation = hf_config.get("hidden_act", "silu")
    if activation != "silu":
        raise ArchitectureError(f"unsupported hidden_act {activation!r} (supported: silu)")
    heads = hf_config["num_attention_heads"]
    pad_token_id = hf_config.get("pad_token_id")
    return Qwen3Config(
        vocab_size=hf_config["vocab_size"],
        d_model=hf_config["hidden_size"],
        num_heads=heads,
        num_kv_heads=hf_config.get("num_key_value_heads") or heads,
        head_dim=hf_config.get("head_dim") or hf_config["hidden_size"] // heads,
        num_layers=hf_config["num_hidden_layers"],
        ffn_dim=hf_config["intermediate_size"],
        max_positions=hf_config.get("max_position_embeddings", 32768),
        pad_token_id=pad_token_id if isinstance(pad_token_id, int) else 0,
        rms_norm_eps=hf_config.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta(hf_config),
        attention_bias=bool(hf_config.get("attention_bias", False)),
        pooling=pooling,
        normalize=normalize,
    )


def rename_weights(weights: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Qwen3's parameter names (bare, or under model. / 0.auto_model.) -> this module's; head weights apart."""
    return split_weights(weights, _WRAPPERS, _DECODER_PREFIXES, HEAD_PREFIXES)


class RMSNorm(nn.Module):
    """w ⊙ x / √(mean(x²) + ε) over the last axis, computed in fp32."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, hidden: Tensor) -> Tensor:
        """Normalise hidden [..., width]."""
        values = hidden.to(torch.float32)
        values = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * values.to(hidden.dtype)


class MLP(nn.Module):
    """SwiGLU: W_down(silu(x·W_gate) ⊙ x·W_up)."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.d_model, config.ffn_dim, bias=False)
        self.up_proj = nn.Linear(config.d_model, config.ffn_dim, bias=False)
        self.down_proj = nn.Linear(config.ffn_dim, config.d_model, bias=False)

    def forward(self, hidden: Tensor) -> Tensor:
        """Apply the network to every position independently."""
        return self.down_proj(F.silu(self.gate_proj(hidden)) * self.up_proj(hidden))


class Layer(nn.Module):
    """One pre-norm decoder layer: x = x + Attention(RMSNorm(x)); x = x + MLP(RMSNorm(x))."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.d_model, config.rms_norm_eps)
        self.self_attn = GroupedQueryAttention(
            config,
            scale=config.head_dim**-0.5,
            head_norm=lambda width: RMSNorm(width, config.rms_norm_eps),
        )
        self.post_attention_layernorm = RMSNorm(config.d_model, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, hidden: Tensor, rotary: tuple[Tensor, Tensor], attention_bias: Tensor) -> Tensor:
        """Transform hidden states [batch, seq, d_model]."""
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rotary, attention_bias)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Qwen3Encoder(nn.Module):
    """The decoder as an embedder: embeddings, S causal layers, final RMSNorm, pooling (last token)."""

    output_names = ("last_hidden_state", "embedding")

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.d_model, config.rms_norm_eps)
        self.rotary = RotaryTable(config.head_dim, config.rope_theta, config.max_positions)

    def hidden_states(
        self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """The last hidden states [batch, seq, d_model] and the float mask [batch, seq]."""
        hidden = self.embed_tokens(input_ids)
        mask = attention_mask.to(hidden.dtype)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        causal = (positions[None, :] <= positions[:, None])[None, None]  # [1, 1, seq, seq]: key j ≤ query i
        keys = attention_mask[:, None, None, :].bool()  # [batch, 1, 1, seq]
        zero = torch.zeros((), dtype=hidden.dtype, device=hidden.device)
        attention_bias = torch.where(keys & causal, zero, torch.finfo(hidden.dtype).min)
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
