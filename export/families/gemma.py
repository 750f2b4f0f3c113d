"""Gemma3's text model in its bidirectional encoder form (EmbeddingGemma), from its definition.

Token embeddings, multiplied by √d_model, feed S layers, each with four RMSNorms around its two
blocks: x = x + N_post_attn(Attention(N_in(x))); x = x + N_post_ff(MLP(N_pre_ff(x))), then a
final RMSNorm. Gemma's RMSNorm scales by (1 + w): (1 + w) ⊙ x / √(mean(x²) + ε), computed in fp32.
Attention is grouped-query (H query heads share K key/value heads, each d_k wide); each query and
key head is RMS-normalised (q_norm, k_norm) before rotary angles turn it, and scores are scaled by
1/√query_pre_attn_scalar (not 1/√d_k). With use_bidirectional_attention every token attends to
every unmasked token, in both directions; a "sliding_attention" layer only to those within
sliding_window // 2 positions on either side (transformers reads config.json's window W as an
exclusive bound of W // 2 + 1), and takes its rotary angles from the local base, a
"full_attention" layer from the global one. The MLP is GeGLU with GELU's tanh form:
W_down(gelu_tanh(x·W_gate) ⊙ x·W_up).

Positions count from 0 at the first column whatever the padding, as in transformers; the scores
depend on the distance between two tokens only (rotary angles, the window), so a right-padded row
gives the same states as a left-padded one. Gemma3's causal (decoder) form, logit soft-capping
and rotary scaling are refused by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from export.checkpoints.architecture_error import ArchitectureError
from export.families.config_facts import OwnEncoderFacts
from export.layers.grouped_attention import GroupedQueryAttention
from export.layers.pooling import pool
from export.layers.rotary import RotaryTable

SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_TYPES = (SLIDING, FULL)
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_new")
"""config.json's hidden_activation names for GELU's tanh form (the only MLP activation implemented)."""
SLIDING_WINDOW_PATTERN = 6
"""transformers' default when config.json lists no layer_types: every sixth layer is a full_attention one."""


@dataclass(frozen=True)
class GemmaConfig(OwnEncoderFacts):
    """Hyper-parameters of a bidirectional Gemma3 text encoder, validated on construction."""

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
    """Width of the MLP's gate and up projections."""
    layer_types: tuple[str, ...]
    """Each layer's attention: sliding_attention (a window) or full_attention."""
    sliding_window: int
    """config.json's sliding_window: a sliding layer's token attends to those at most sliding_window // 2 away."""
    query_pre_attn_scalar: float
    """Scores are q·k / √query_pre_attn_scalar."""
    rope_theta: float = 1_000_000.0
    """Rotary base of the full_attention layers."""
    rope_local_theta: float = 10_000.0
    """Rotary base of the sliding_attention layers."""
    max_positions: int = 2048
    pad_token_id: int = 0
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    pooling: str = "mean"
    normalize: bool = True

    def __post_init__(self) -> None:
        sizes = ("vocab_size", "d_model", "num_heads", "num_kv_heads", "head_dim", "num_layers", "ffn_dim")
        self.check_sizes_and_pooling((*sizes, "sliding_window"))
        if self.num_heads % self.num_kv_heads:
            raise ArchitectureError(
                f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ArchitectureError(f"head_dim {self.head_dim} must be even (rotary angles turn pairs)")
        if len(self.layer_types) != self.num_layers:
            raise ArchitectureError(f"layer_types lists {len(self.layer_types)} layers, not {self.num_layers}")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ArchitectureError(f"unsupported layer_types {unknown[0]!r} (supported: {', '.join(LAYER_TYPES)})")

    @property
    def window_radius(self) -> int:
        """How far a sliding_attention layer's token looks either side (transformers' exclusive W // 2 + 1)."""
        return self.sliding_window // 2


def _rope_thetas(hf_config: dict) -> tuple[float, float]:
    """(full_attention's, sliding_attention's) rotary bases; anything but plain rotary angles is refused by name.

    transformers 5 writes rope_parameters per layer type; earlier configs rope_theta, rope_local_base_freq and
    rope_scaling (the full_attention layers').
    """
    parameters = hf_config.get("rope_parameters") or {}
    legacy_scaling = hf_config.get("rope_scaling") or {}
    declared = [("rope_scaling", legacy_scaling)] + [
        (f"rope_parameters {kind}", parameters.get(kind) or {}) for kind in LAYER_TYPES
    ]
    for source, settings in declared:
        kind = settings.get("rope_type", settings.get("type", "default"))
        if kind != "default":
            raise ArchitectureError(f"unsupported {source} rope_type {kind!r}: only default rotary angles")
    full = (parameters.get(FULL) or {}).get("rope_theta", hf_config.get("rope_theta", 1_000_000.0))
    local = (parameters.get(SLIDING) or {}).get("rope_theta", hf_config.get("rope_local_base_freq", 10_000.0))
    return float(full), float(local)


def _layer_types(hf_config: dict) -> tuple[str, ...]:
    declared = hf_config.get("layer_types")
    if declared:
        return tuple(declared)
    pattern = hf_config.get("sliding_window_pattern", SLIDING_WINDOW_PATTERN)
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(hf_config["num_hidden_layers"]))


def config_from_hf(hf_config: dict, pooling: str, normalize: bool) -> GemmaConfig:
    """Translate a Hugging Face gemma3_text config.json with use_bidirectional_attention (EmbeddingGemma)."""
    for key in ("vocab_size", "hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size"):
        if key not in hf_config:
            raise ArchitectureError(f"config.json lacks {key!r}")
    if hf_config.get("use_bidirectional_attention") is not True:
        raise ArchitectureError(
            "unsupported use_bidirectional_attention false (Gemma3's causal decoder form): only the bidirectional"
            " encoder form (EmbeddingGemma)"
        )
    for key in ("attn_logit_softcapping",):
        if hf_config.get(key) is not None:
            raise ArchitectureError(f"unsupported {key} {hf_config[key]!r} (only null)")
    activation = hf_config.get("hidden_activation", "gelu_pytorch_tanh")
    if activation not in ACTIVATIONS:
        raise ArchitectureError(f"unsupported hidden_activation {activation!r} (supported: {', '.join(ACTIVATIONS)})")
    heads = hf_config["num_attention_heads"]
    pad_token_id = hf_config.get("pad_token_id")
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
    full_theta, local_theta = _rope_thetas(hf_config)
    return GemmaConfig(
        vocab_size=hf_config["vocab_size"],
        d_model=hf_config["hidden_size"],
        num_heads=heads,
        num_kv_heads=hf_config.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        num_layers=hf_config["num_hidden_layers"],
        ffn_dim=hf_config["intermediate_size"],
        layer_types=_layer_types(hf_config),
        sliding_window=hf_config.get("sliding_window", 4096),
        query_pre_attn_scalar=float(hf_config.get("query_pre_attn_scalar", 256)),
        rope_theta=full_theta,
        rope_local_theta=local_theta,
        max_positions=hf_config.get("max_position_embeddings", 2048),
        pad_token_id=pad_token_id if isinstance(pad_token_id, int) else 0,
        rms_norm_eps=hf_config.get("rms_norm_eps", 1e-6),
        attention_bias=bool(hf_config.get("attention_bias", False)),
        pooling=pooling,
        normalize=normalize,
    )


class GemmaRMSNorm(nn.Module):
    """(1 + w) ⊙ x / √(mean(x²) + ε) over the last axis, computed in fp32 (w starts at 0)."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(width))
        self.eps = eps

    def forward(self, hidden: Tensor) -> Tensor:
        """Normalise hidden [..., width]."""
        values = hidden.to(torch.float32)
        values = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + self.eps)
        return (values * (1.0 + self.weight.to(torch.float32))).to(hidden.dtype)


class MLP(nn.Module):
    """GeGLU: W_down(gelu_tanh(x·W_gate) ⊙ x·W_up)."""

    def __init__(self, config: GemmaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.d_model, config.ffn_dim, bias=False)
        self.up_proj = nn.Linear(config.d_model, config.ffn_dim, bias=False)
        self.down_proj = nn.Linear(config.ffn_dim, config.d_model, bias=False)

    def forward(self, hidden: Tensor) -> Tensor:
        """Apply the network to every position independently."""
        return self.down_proj(F.gelu(self.gate_proj(hidden), approximate="tanh") * self.up_proj(hidden))


class Layer(nn.Module):
    """One layer: x = x + N(Attention(N(x))); x = x + N(MLP(N(x))), four RMSNorms of their own."""

    def __init__(self, config: GemmaConfig) -> None:
        super().__init__()
        self.input_layernorm = GemmaRMSNorm(config.d_model, config.rms_norm_eps)
        self.self_attn = GroupedQueryAttention(
            config,
            scale=config.query_pre_attn_scalar**-0.5,
            head_norm=lambda width: GemmaRMSNorm(width, config.rms_norm_eps),
        )
        self.post_attention_layernorm = GemmaRMSNorm(config.d_model, config.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.d_model, config.rms_norm_eps)
        self.mlp = MLP(config)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.d_model, config.rms_norm_eps)

    def forward(self, hidden: Tensor, rotary: tuple[Tensor, Tensor], attention_bias: Tensor) -> Tensor:
        """Transform hidden states [batch, seq, d_model]."""
        attended = self.self_attn(self.input_layernorm(hidden), rotary, attention_bias)
        hidden = hidden + self.post_attention_layernorm(attended)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class GemmaEncoder(nn.Module):
    """The bidirectional Gemma3 text model: scaled embeddings, S layers, final RMSNorm, pooling."""

    output_names = ("last_hidden_state", "embedding")

    def __init__(self, config: GemmaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.num_layers))
        self.norm = GemmaRMSNorm(config.d_model, config.rms_norm_eps)
        self.rotary = nn.ModuleDict(
            {
                FULL: RotaryTable(config.head_dim, config.rope_theta, config.max_positions),
                SLIDING: RotaryTable(config.head_dim, config.rope_local_theta, config.max_positions),
            }
        )

    def _attention_biases(self, attention_mask: Tensor, dtype: torch.dtype) -> dict[str, Tensor]:
        """Each layer type's additive bias: 0 where a query may read a key, the dtype's minimum elsewhere."""
        length = attention_mask.shape[1]
        keys = attention_mask[:, None, None, :].bool()  # [batch, 1, 1, seq]
        positions = torch.arange(length, device=attention_mask.device)
        near = (positions[None, :] - positions[:, None]).abs() <= self.config.window_radius  # [seq, seq]
        zero = torch.zeros((), dtype=dtype, device=attention_mask.device)
        blocked = torch.finfo(dtype).min
        return {FULL: torch.where(keys, zero, blocked), SLIDING: torch.where(keys & near[None, None], zero, blocked)}

    def hidden_states(
        self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """The last hidden states [batch, seq, d_model] and the float mask [batch, seq]."""
        weights = self.embed_tokens.weight
        hidden = self.embed_tokens(input_ids) * torch.tensor(math.sqrt(self.config.d_model), dtype=weights.dtype)
        length = input_ids.shape[1]
        biases = self._attention_biases(attention_mask, hidden.dtype)
        rotary = {kind: table(length, hidden.dtype) for kind, table in self.rotary.items()}
        for layer, kind in zip(self.layers, self.config.layer_types, strict=True):
            hidden = layer(hidden, rotary[kind], biases[kind])
        return self.norm(hidden), attention_mask.to(hidden.dtype)

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Return (last_hidden_state [batch, seq, d_model], embedding [batch, d_model])."""
        hidden, mask = self.hidden_states(input_ids, attention_mask)
        return hidden, pool(hidden, mask, self.config.pooling, self.config.normalize)
