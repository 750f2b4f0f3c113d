"""ModernBERT from its definition: pre-norm layers, rotary positions, gated GeLU, local and global attention.

Token embeddings and LayerNorm (no position table, no segments) feed S pre-norm layers:
x = x + Attention(LN(x)); x = x + MLP(LN(x)), the first layer without its attention LayerNorm.
Attention projects Q, K and V with one fused matrix, turns Q and K by rotary position angles
(a larger base for global layers than for local ones), and lets every token see the whole
sequence (global layers, every `global_every`-th from the first) or only the tokens within half
the local window on either side (local layers). The MLP is gated: act(x·W_in) ⊙ (x·W_gate), then
W_out. A final LayerNorm, then pooling (export.layers.pooling) as for every encoder here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from export.checkpoints.architecture_error import ArchitectureError
from export.checkpoints.weight_names import split_weights
from export.families.encoder_config import EncoderConfigBase, read_activation, read_shared_fields
from export.families.family import BERT_FUSIONS, Family, Format
from export.layers.attention import attend
from export.layers.feed_forward import activate
from export.layers.pooling import PooledEncoder
from export.layers.rotary import RotaryTable, rotate

ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "silu": "silu"}


@dataclass(frozen=True, kw_only=True)
class ModernBertConfig(EncoderConfigBase):
    """Hyper-parameters of a ModernBERT encoder, validated on construction (ffn_dim: W_in projects to twice it)."""

    max_positions: int = 8192
    layer_norm_eps: float = 1e-5
    norm_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    activation: str = "gelu"
    global_rope_theta: float = 160_000.0
    local_rope_theta: float = 10_000.0
    local_attention: int = 128
    """The local window: a local layer's token sees local_attention // 2 tokens on either side."""
    global_layers: tuple[bool, ...] = ()
    """Per layer: global attention (True) or local (False)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_positive(("local_attention",))
        if self.d_model % self.num_heads or (self.d_model // self.num_heads) % 2:
            raise ArchitectureError(f"d_model {self.d_model} / num_heads {self.num_heads} must be an even head width")
        if len(self.global_layers) != self.num_layers:
            raise ArchitectureError(f"{len(self.global_layers)} layer types for {self.num_layers} layers")
        if self.activation not in ACTIVATIONS.values():
            raise ArchitectureError(f"unsupported activation {self.activation!r}")

    @property
    def head_dim(self) -> int:
        """d_k: the width of one attention head."""
        return self.d_model // self.num_heads


def config_from_hf(hf_config: dict, pooling: str, normalize: bool) -> ModernBertConfig:
    """Translate a Hugging Face ModernBERT config.json."""
    shared = read_shared_fields(hf_config, pooling, normalize)
    layers = hf_config["num_hidden_layers"]
    types = hf_config.get("layer_types")
    if types:
        global_layers = tuple(kind == "full_attention" for kind in types)
    else:
        every = hf_config.get("global_attn_every_n_layers", 3)
        global_layers = tuple(index % every == 0 for index in range(layers))
    rope = hf_config.get("rope_parameters") or {}
    activation = read_activation(hf_config, "hidden_activation", ACTIVATIONS, "gelu")
    for kind in ("full_attention", "sliding_attention"):
        if rope.get(kind, {}).get("rope_type", "default") != "default":
            raise ArchitectureError(f"unsupported rope_type {rope[kind]['rope_type']!r}: only default rotary angles")
    return ModernBertConfig(
        **shared,
        max_positions=hf_config.get("max_position_embeddings", 8192),
        layer_norm_eps=hf_config.get("norm_eps", 1e-5),
        norm_bias=hf_config.get("norm_bias", False),
        attention_bias=hf_config.get("attention_bias", False),
        mlp_bias=hf_config.get("mlp_bias", False),
        activation=activation,
        global_rope_theta=rope.get("full_attention", {}).get(
            "rope_theta", hf_config.get("global_rope_theta", 160_000.0)
        ),
        local_rope_theta=rope.get("sliding_attention", {}).get(
            "rope_theta", hf_config.get("local_rope_theta", 10_000.0)
        ),
        local_attention=hf_config.get("local_attention", 128),
        global_layers=global_layers,
    )


def rename_weights(weights: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """ModernBERT's parameter names -> this module's, and the task heads' weights (head., classifier.) apart."""
    return split_weights(
        weights,
        ("model.", "0.auto_model."),
        ("embeddings.", "layers.", "final_norm."),
        ("head.", "classifier.", "decoder."),
    )


class Embeddings(nn.Module):
    """Token embeddings, then LayerNorm."""

    def __init__(self, config: ModernBertConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.d_model, padding_idx=config.pad_token_id)
        self.norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps, bias=config.norm_bias)

    def forward(self, input_ids: Tensor) -> Tensor:
        """Embed ids [batch, seq] into [batch, seq, d_model]."""
        return self.norm(self.tok_embeddings(input_ids))


class Attention(nn.Module):
    """Multi-head self-attention with rotary positions: softmax(QKᵀ/√d_k + mask)·V, then W^O."""

    def __init__(self, config: ModernBertConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.Wqkv = nn.Linear(config.d_model, 3 * config.d_model, bias=config.attention_bias)
        self.Wo = nn.Linear(config.d_model, config.d_model, bias=config.attention_bias)

    def forward(self, hidden: Tensor, rotary: tuple[Tensor, Tensor], attention_bias: Tensor) -> Tensor:
        """Attend over hidden [batch, seq, d_model]; rotary is (cos, sin) [seq, head_dim]; bias [batch, 1, seq, seq]."""
        batch, length = hidden.shape[0], hidden.shape[1]
        qkv = self.Wqkv(hidden).view(batch, length, 3, self.num_heads, self.head_dim)
        query, key, value = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # [batch, heads, seq, d_k]
        query, key = rotate(query, *rotary), rotate(key, *rotary)
        scores = torch.matmul(query, key.transpose(-1, -2)) / math.sqrt(self.head_dim)
        context = attend(scores, attention_bias, value, batch, length)
        return self.Wo(context)


class MLP(nn.Module):
    """The gated feed-forward network: act(x·W_in) ⊙ (x·W_gate), then W_out (W_in and W_gate are one matrix, Wi)."""

    def __init__(self, config: ModernBertConfig) -> None:
        super().__init__()
        self.Wi = nn.Linear(config.d_model, 2 * config.ffn_dim, bias=config.mlp_bias)
        self.Wo = nn.Linear(config.ffn_dim, config.d_model, bias=config.mlp_bias)
        self.activation = config.activation

    def forward(self, hidden: Tensor) -> Tensor:
        """Apply the network to every position independently."""
        inner, gate = self.Wi(hidden).chunk(2, dim=-1)
        return self.Wo(activate(self.activation, inner) * gate)


class Layer(nn.Module):
    """One pre-norm layer: x = x + Attention(LN(x)); x = x + MLP(LN(x)); the first has no attention LayerNorm."""

    def __init__(self, config: ModernBertConfig, index: int) -> None:
        super().__init__()
        eps, bias = config.layer_norm_eps, config.norm_bias
        self.attn_norm = nn.Identity() if index == 0 else nn.LayerNorm(config.d_model, eps=eps, bias=bias)
        self.attn = Attention(config)
        self.mlp_norm = nn.LayerNorm(config.d_model, eps=eps, bias=bias)
        self.mlp = MLP(config)

    def forward(self, hidden: Tensor, rotary: tuple[Tensor, Tensor], attention_bias: Tensor) -> Tensor:
        """Transform hidden states [batch, seq, d_model]."""
        hidden = hidden + self.attn(self.attn_norm(hidden), rotary, attention_bias)
        return hidden + self.mlp(self.mlp_norm(hidden))


class ModernBertEncoder(PooledEncoder):
    """The whole encoder: embeddings, S layers of global or local attention, final LayerNorm, pooling."""

    def __init__(self, config: ModernBertConfig) -> None:
        super().__init__(config)
        self.embeddings = Embeddings(config)
        self.layers = nn.ModuleList(Layer(config, index) for index in range(config.num_layers))
        self.final_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps, bias=config.norm_bias)
        self.global_rotary = RotaryTable(config.head_dim, config.global_rope_theta, config.max_positions)
        self.local_rotary = RotaryTable(config.head_dim, config.local_rope_theta, config.max_positions)

    def hidden_states(
        self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """The last hidden states [batch, seq, d_model] and the float mask [batch, seq] (task heads start here)."""
        hidden = self.embeddings(input_ids)
        mask = attention_mask.to(hidden.dtype)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        keys = attention_mask[:, None, None, :].bool()  # [batch, 1, 1, seq]
        distance = (positions[:, None] - positions[None, :]).abs()
        in_window = (distance <= self.config.local_attention // 2)[None, None]  # [1, 1, seq, seq]
        lowest = torch.finfo(hidden.dtype).min
        zero = torch.zeros((), dtype=hidden.dtype, device=hidden.device)
        global_bias = torch.where(keys, zero, lowest)
        local_bias = torch.where(keys & in_window, zero, lowest)
        length = input_ids.shape[1]
        layer_inputs = {
            True: (self.global_rotary(length, hidden.dtype), global_bias),
            False: (self.local_rotary(length, hidden.dtype), local_bias),
        }
        for layer, is_global in zip(self.layers, self.config.global_layers, strict=True):
            hidden = layer(hidden, *layer_inputs[is_global])
        return self.final_norm(hidden), mask


FAMILY = Family(
    name="modernbert",
    config_type=ModernBertConfig,
    build=ModernBertEncoder,
    formats=(Format("modernbert", config_from_hf, rename_weights, "modernbert"),),
    graph_forms=BERT_FUSIONS,
)
"""ModernBERT."""
