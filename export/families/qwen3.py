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
from torch import Tensor

from export.checkpoints.architecture_error import ArchitectureError
from export.families.encoder_config import read_activation
from export.families.family import Family, Format
from export.layers.decoder import SWIGLU_ACTIVATION, DecoderConfig, DecoderEncoder, decoder_weights, read_decoder_fields
from export.layers.rotary import rope_theta

HEAD_PREFIXES = ("lm_head.", "score.")
"""Weights of a causal-LM or classification head, set apart from the decoder's."""


@dataclass(frozen=True, kw_only=True)
class Qwen3Config(DecoderConfig):
    """Hyper-parameters of a Qwen3 decoder used as an embedder, validated on construction."""

    max_positions: int = 32768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    pooling: str = "lasttoken"


def config_from_hf(hf_config: dict, pooling: str, normalize: bool) -> Qwen3Config:
    """Translate a Hugging Face Qwen3 config.json (Qwen3Model / Qwen3ForCausalLM)."""
    fields = read_decoder_fields(Qwen3Config, hf_config, pooling, normalize)
    if hf_config.get("use_sliding_window"):
        raise ArchitectureError("unsupported use_sliding_window true (sliding-window attention): only full attention")
    layer_types = hf_config.get("layer_types") or []
    if any(kind != "full_attention" for kind in layer_types):
        unsupported = next(kind for kind in layer_types if kind != "full_attention")
        raise ArchitectureError(f"unsupported layer_types {unsupported!r}: only full_attention")
    read_activation(hf_config, "hidden_act", SWIGLU_ACTIVATION, "silu")
    return Qwen3Config(**fields, rope_theta=rope_theta(hf_config))


rename_weights = decoder_weights(HEAD_PREFIXES)
"""Qwen3's parameter names (bare, or under model. / 0.auto_model.) -> this module's; head weights apart."""


class Qwen3Encoder(DecoderEncoder):
    """The decoder as an embedder: embeddings, S causal layers, final RMSNorm, pooling (last token)."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config, activation=F.silu, scale=config.head_dim**-0.5, head_norm=True)

    def reach(self, attention_mask: Tensor) -> Tensor:
        """A token reads itself and the earlier tokens the mask keeps (causal)."""
        positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
        causal = (positions[None, :] <= positions[:, None])[None, None]  # [1, 1, seq, seq]: key j ≤ query i
        return super().reach(attention_mask) & causal


FAMILY = Family(
    name="qwen3",
    config_type=Qwen3Config,
    build=Qwen3Encoder,
    formats=(Format("qwen3", config_from_hf, rename_weights),),
)
"""Qwen3 read as an embedder (Qwen3-Embedding; Qwen3-Reranker with export.heads.yes_no)."""
