"""BERT with rotary positions: GTE, NomicBERT and jina-embeddings-v3, from their definition.

Token embeddings (+ segment embeddings where the model has them; no position table), then
LayerNorm, feed S post-norm layers, as BERT's: x = LN(x + Attention(x)); x = LN(x + FFN(x)).
Attention projects Q, K and V with one matrix, turns Q and K by rotary position angles
(export.layers.rotary) and attends over the whole sequence: softmax(QKᵀ/√d_k + mask)·V, then W^O.
The feed-forward network is gated: W_down(act(x·W_gate) ⊙ (x·W_up)), with GeLU (GTE) or SiLU
(NomicBERT: SwiGLU); W_up and W_gate are one matrix here; or plain, W_down(act(x·W_up))
(jina-embeddings-v3, XLM-R's). Which projections carry a bias is the family's: GTE's attention and
W_down do, NomicBERT's none, Jina's all. jina-embeddings-v3's task adapters (export.layers.task_adapters)
add a LoRA delta to the token embedding and the projections they adapt, each token taking its own
task's (graph input adapter_ids, per token; 0: none). The last hidden state is pooled
(export.layers.pooling) as for every encoder here. The families' config.json and weight names are read
by export.families.rotary_bert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from export.checkpoints.architecture_error import ArchitectureError
from export.families.encoder_config import EncoderConfigBase
from export.layers.attention import attend
from export.layers.feed_forward import activate
from export.layers.pooling import PooledEncoder
from export.layers.rotary import RotaryTable, rotate
from export.layers.segments import SegmentEmbedding
from export.layers.task_adapters import TaskLora

ACTIVATIONS = ("gelu", "gelu_tanh", "silu", "relu")


@dataclass(frozen=True, kw_only=True)
class RotaryBertConfig(EncoderConfigBase):
    """Hyper-parameters of a rotary, post-norm BERT (GTE, NomicBERT, Jina), validated on construction.

    ffn_dim is the width of the inner layer (W_up and, gated, W_gate each project to it); max_positions the
    longest sequence the model was made for (rotary angles themselves have no limit).
    """

    head_dim: int
    """d_k: the width of one attention head (num_heads · head_dim need not be d_model)."""
    rope_theta: float
    """The rotary base θ."""
    rope_linear_factor: float = 1.0
    """Linear rotary scaling: every frequency divided by it (1: none)."""
    type_vocab_size: int = 0
    """Segment ids; 0: no segment embedding; 1: its one row added to every token, no input."""
    activation: str = "gelu"
    """The gate's activation: gelu, gelu_tanh, silu or relu."""
    layer_norm_eps: float = 1e-12
    attention_bias: bool = True
    """Whether the Q, K, V and output projections carry a bias."""
    up_gate_bias: bool = False
    """Whether W_up (and W_gate) carry a bias."""
    down_bias: bool = True
    gated: bool = True
    """Gated feed-forward (W_up and W_gate) or plain (W_up alone)."""
    tasks: tuple[str, ...] = ()
    """Task adapters, id = position + 1 in adapter_ids (0: none); empty: the model has none."""
    lora_columns: tuple[tuple[str, int], ...] = ()
    """Each adapted module (as the encoder names it, e.g. layers.0.attention.qkv) and its LoRA columns."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_positive(("head_dim",))
        if self.head_dim % 2:
            raise ArchitectureError(f"head width {self.head_dim} must be even for rotary positions")
        if self.rope_theta <= 0 or self.rope_linear_factor <= 0:
            raise ArchitectureError(f"rotary base {self.rope_theta} and factor {self.rope_linear_factor} must be > 0")
        if not isinstance(self.type_vocab_size, int) or self.type_vocab_size < 0:
            raise ArchitectureError(f"type_vocab_size must be >= 0, got {self.type_vocab_size!r}")
        if self.activation not in ACTIVATIONS:
            raise ArchitectureError(f"unsupported activation {self.activation!r} (supported: {', '.join(ACTIVATIONS)})")
        self.check_pad_token_id()
        if self.tasks and self.uses_segments:
            raise ArchitectureError("task adapters with segment ids (type_vocab_size > 1) are not implemented")

    def lora(self, module: str, width_in: int, width_out: int, embedding: bool = False) -> TaskLora | None:
        """The task adapters' LoRA of one module of the encoder; None where no adapter changes it."""
        columns = dict(self.lora_columns).get(module)
        return None if columns is None else TaskLora(width_in, width_out, columns, embedding)


class Embeddings(nn.Module):
    """Token (+ segment) embeddings, then LayerNorm."""

    def __init__(self, config: RotaryBertConfig) -> None:
        super().__init__()
        self.token = nn.Embedding(config.vocab_size, config.d_model, padding_idx=config.pad_token_id)
        self.token_lora = config.lora("embeddings.token", config.vocab_size, config.d_model, embedding=True)
        self.segment = SegmentEmbedding(config.type_vocab_size, config.d_model) if config.type_vocab_size else None
        self.norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None, adapter_ids: Tensor | None = None) -> Tensor:
        """Embed ids [batch, seq] into [batch, seq, d_model]."""
        hidden = self.token(input_ids)
        if self.token_lora is not None and adapter_ids is not None:
            hidden = hidden + self.token_lora(input_ids, adapter_ids)
        if self.segment is not None:
            hidden = hidden + self.segment(input_ids, token_type_ids)
        return self.norm(hidden)


class Attention(nn.Module):
    """Multi-head self-attention with rotary positions: softmax(QKᵀ/√d_k + mask)·V, then W^O."""

    def __init__(self, config: RotaryBertConfig, name: str) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        width = config.num_heads * config.head_dim
        self.qkv = nn.Linear(config.d_model, 3 * width, bias=config.attention_bias)
        self.qkv_lora = config.lora(f"{name}.qkv", config.d_model, 3 * width)
        self.output = nn.Linear(width, config.d_model, bias=config.attention_bias)
        self.output_lora = config.lora(f"{name}.output", width, config.d_model)

    def forward(
        self, hidden: Tensor, rotary: tuple[Tensor, Tensor], attention_bias: Tensor, adapter_ids: Tensor | None = None
    ) -> Tensor:
        """Attend over hidden [batch, seq, d_model]; rotary is (cos, sin) [seq, head_dim]; bias [batch, 1, 1, seq]."""
        batch, length = hidden.shape[0], hidden.shape[1]
        qkv = _adapted(self.qkv, self.qkv_lora, hidden, adapter_ids).view(
            batch, length, 3, self.num_heads, self.head_dim
        )
        query, key, value = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # [batch, heads, seq, d_k]
        query, key = rotate(query, *rotary), rotate(key, *rotary)
        scores = torch.matmul(query, key.transpose(-1, -2)) * self.head_dim**-0.5
        context = attend(scores, attention_bias, value, batch, length)
        return _adapted(self.output, self.output_lora, context, adapter_ids)


class FeedForward(nn.Module):
    """The feed-forward network: gated, W_down(act(x·W_gate) ⊙ (x·W_up)), or plain, W_down(act(x·W_up)).

    The gated one holds W_up and W_gate as one matrix, up_gate; the plain one W_up as up.
    """

    def __init__(self, config: RotaryBertConfig, name: str) -> None:
        super().__init__()
        self.gated = config.gated
        if config.gated:
            self.up_gate = nn.Linear(config.d_model, 2 * config.ffn_dim, bias=config.up_gate_bias)
        else:
            self.up = nn.Linear(config.d_model, config.ffn_dim, bias=config.up_gate_bias)
            self.up_lora = config.lora(f"{name}.up", config.d_model, config.ffn_dim)
        self.down = nn.Linear(config.ffn_dim, config.d_model, bias=config.down_bias)
        self.down_lora = config.lora(f"{name}.down", config.ffn_dim, config.d_model)
        self.activation = config.activation

    def forward(self, hidden: Tensor, adapter_ids: Tensor | None = None) -> Tensor:
        """Apply the network to every position independently."""
        if self.gated:
            up, gate = self.up_gate(hidden).chunk(2, dim=-1)
            inner = activate(self.activation, gate) * up
        else:
            inner = activate(self.activation, _adapted(self.up, self.up_lora, hidden, adapter_ids))
        return _adapted(self.down, self.down_lora, inner, adapter_ids)


class Layer(nn.Module):
    """One post-norm layer: x = LN(x + Attention(x)); x = LN(x + FFN(x))."""

    def __init__(self, config: RotaryBertConfig, index: int) -> None:
        super().__init__()
        self.attention = Attention(config, f"layers.{index}.attention")
        self.attention_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.feed_forward = FeedForward(config, f"layers.{index}.feed_forward")
        self.output_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)

    def forward(
        self, hidden: Tensor, rotary: tuple[Tensor, Tensor], attention_bias: Tensor, adapter_ids: Tensor | None = None
    ) -> Tensor:
        """Transform hidden states [batch, seq, d_model]."""
        hidden = self.attention_norm(hidden + self.attention(hidden, rotary, attention_bias, adapter_ids))
        return self.output_norm(hidden + self.feed_forward(hidden, adapter_ids))


class RotaryBertEncoder(PooledEncoder):
    """The whole encoder: embeddings, S rotary post-norm layers, pooling."""

    def __init__(self, config: RotaryBertConfig) -> None:
        super().__init__(config)
        self.embeddings = Embeddings(config)
        self.layers = nn.ModuleList(Layer(config, index) for index in range(config.num_layers))
        self.rotary = RotaryTable(config.head_dim, config.rope_theta, config.max_positions, config.rope_linear_factor)

    def hidden_states(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        token_type_ids: Tensor | None = None,
        *,
        adapter_ids: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """The last hidden states [batch, seq, d_model] and the float mask [batch, seq] (task heads start here).

        adapter_ids [batch, seq]: each token's task adapter (0 or None: none).
        """
        hidden = self.embeddings(input_ids, token_type_ids, adapter_ids)
        mask = attention_mask.to(hidden.dtype)
        attention_bias = (1.0 - mask[:, None, None, :]) * torch.finfo(hidden.dtype).min
        rotary = self.rotary(input_ids.shape[1], hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, rotary, attention_bias, adapter_ids)
        return hidden, mask


def _adapted(linear: nn.Linear, lora: TaskLora | None, x: Tensor, adapter_ids: Tensor | None) -> Tensor:
    """linear(x), plus each token's task delta where the module has adapters."""
    if lora is None or adapter_ids is None:
        return linear(x)
    return linear(x) + lora(x, adapter_ids)
