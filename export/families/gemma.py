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
from export.families.encoder_config import read_activation
from export.families.family import Family, Format
from export.layers.decoder import (
    DecoderConfig,
    DecoderEncoder,
    RMSNorm,
    Rotary,
    attention_bias,
    decoder_weights,
    read_decoder_fields,
)
from export.layers.rotary import RotaryTable

SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_TYPES = (SLIDING, FULL)
ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
"""config.json's hidden_activation names for GELU's tanh form (the only MLP activation implemented)."""
HEAD_PREFIXES = ("lm_head.", "score.")
"""Weights of a causal-LM or classification head, set apart from the text model's."""
SLIDING_WINDOW_PATTERN = 6
"""transformers' default when config.json lists no layer_types: every sixth layer is a full_attention one."""


@dataclass(frozen=True, kw_only=True)
class GemmaConfig(DecoderConfig):
    """Hyper-parameters of a bidirectional Gemma3 text encoder, validated on construction."""

    max_positions: int = 2048
    rope_theta: float = 1_000_000.0
    """Rotary base of the full_attention layers."""
    layer_types: tuple[str, ...]
    """Each layer's attention: sliding_attention (a window) or full_attention."""
    sliding_window: int
    """config.json's sliding_window: a sliding layer's token attends to those at most sliding_window // 2 away."""
    query_pre_attn_scalar: float
    """Scores are q·k / √query_pre_attn_scalar."""
    rope_local_theta: float = 10_000.0
    """Rotary base of the sliding_attention layers."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_positive(("sliding_window",))
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
    fields = read_decoder_fields(GemmaConfig, hf_config, pooling, normalize)
    if hf_config.get("use_bidirectional_attention") is not True:
        raise ArchitectureError(
            "unsupported use_bidirectional_attention false (Gemma3's causal decoder form): only the bidirectional"
            " encoder form (EmbeddingGemma)"
        )
    for key in ("attn_logit_softcapping",):
        if hf_config.get(key) is not None:
            raise ArchitectureError(f"unsupported {key} {hf_config[key]!r} (only null)")
    read_activation(hf_config, "hidden_activation", ACTIVATIONS, "gelu_pytorch_tanh")
    full_theta, local_theta = _rope_thetas(hf_config)
    return GemmaConfig(
        **fields,
        layer_types=_layer_types(hf_config),
        sliding_window=hf_config.get("sliding_window", 4096),
        query_pre_attn_scalar=float(hf_config.get("query_pre_attn_scalar", 256)),
        rope_theta=full_theta,
        rope_local_theta=local_theta,
    )


class GemmaRMSNorm(RMSNorm):
    """(1 + w) ⊙ x / √(mean(x²) + ε) over the last axis, computed in fp32 (w starts at 0)."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__(width, eps)
        nn.init.zeros_(self.weight)

    def forward(self, hidden: Tensor) -> Tensor:
        """Normalise hidden [..., width]."""
        return (self.normalised(hidden) * (1.0 + self.weight.to(torch.float32))).to(hidden.dtype)


def _gelu_tanh(hidden: Tensor) -> Tensor:
    return F.gelu(hidden, approximate="tanh")


class GemmaEncoder(DecoderEncoder):
    """The bidirectional Gemma3 text model: scaled embeddings, S sandwich-normed layers, final RMSNorm, pooling."""

    def __init__(self, config: GemmaConfig) -> None:
        rotary = nn.ModuleDict(
            {
                FULL: RotaryTable(config.head_dim, config.rope_theta, config.max_positions),
                SLIDING: RotaryTable(config.head_dim, config.rope_local_theta, config.max_positions),
            }
        )
        super().__init__(
            config,
            activation=_gelu_tanh,
            scale=config.query_pre_attn_scalar**-0.5,
            head_norm=True,
            norm=GemmaRMSNorm,
            sandwich=True,
            rotary=rotary,
        )

    def embed(self, input_ids: Tensor) -> Tensor:
        """The token embeddings times √d_model."""
        weights = self.embed_tokens.weight
        return self.embed_tokens(input_ids) * torch.tensor(math.sqrt(self.config.d_model), dtype=weights.dtype)

    def layer_inputs(self, attention_mask: Tensor, dtype: torch.dtype) -> list[tuple[Rotary, Tensor]]:
        """Each layer its type's rotary table and reach: every unmasked token, or those within the window."""
        length = attention_mask.shape[1]
        keys = attention_mask[:, None, None, :].bool()  # [batch, 1, 1, seq]
        positions = torch.arange(length, device=attention_mask.device)
        near = (positions[None, :] - positions[:, None]).abs() <= self.config.window_radius  # [seq, seq]
        biases = {FULL: attention_bias(keys, dtype), SLIDING: attention_bias(keys & near[None, None], dtype)}
        return [(self.rotary[kind](length, dtype), biases[kind]) for kind in self.config.layer_types]


FAMILY = Family(
    name="gemma",
    config_type=GemmaConfig,
    build=GemmaEncoder,
    formats=(Format("gemma3_text", config_from_hf, decoder_weights(HEAD_PREFIXES)),),
)
"""Gemma3's bidirectional text model (EmbeddingGemma)."""
