"""The BERT family: BERT, RoBERTa, XLM-RoBERTa, DistilBERT and MPNet, one encoder written out from its definition.

Embeddings (token + position + segment, then LayerNorm) feed S post-norm layers, each
multi-head self-attention and a position-wise feed-forward network wrapped in residual
Add & LayerNorm; the last hidden state is pooled (export.layers.pooling) and optionally L2-normalised.
Attention is plain matmul/softmax so that ONNX Runtime's optimiser can recognise and fuse it.

The family differs only in configuration: RoBERTa and XLM-R count positions after the
padding id and add their single segment row to every token; DistilBERT has no segments; MPNet
also adds a relative position bias, shared by every layer, to the attention scores. Each model type
is described by how its config.json translates into an EncoderConfig and how its parameter names map
onto the encoder's; weights of task heads (poolers, classifiers, language model heads) are returned
apart, for export.heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import Tensor, nn

from export.checkpoints.architecture_error import ArchitectureError
from export.checkpoints.weight_names import BERT_ATTENTION_OUTPUT, BERT_EMBEDDINGS, BERT_FEED_FORWARD, ModuleRenames
from export.families.encoder_config import EncoderConfigBase, read_activation, read_shared_fields
from export.families.family import BERT_FUSIONS, Family, Format
from export.layers.feed_forward import FeedForward
from export.layers.pooling import PooledEncoder
from export.layers.segments import SegmentEmbedding
from export.sources import UnusableSource

Activation = Literal["gelu", "gelu_tanh", "relu"]
PositionEmbedding = Literal["learned", "sinusoidal"]
PositionIds = Literal["sequential", "after_padding"]


class ConfigError(UnusableSource):
    """An encoder configuration that cannot describe a working model."""


@dataclass(frozen=True, kw_only=True)
class EncoderConfig(EncoderConfigBase):
    """Hyper-parameters of a BERT-style encoder, validated on construction."""

    max_positions: int = 512
    """Longest sequence the position embedding covers."""
    type_vocab_size: int = 2
    """Segment ids; 0: no segment embedding; 1: one segment row added to every token (RoBERTa), no input."""
    activation: Activation = "gelu"
    """Feed-forward activation."""
    layer_norm_eps: float = 1e-12
    """LayerNorm epsilon."""
    position_embedding: PositionEmbedding = "learned"
    """Learned position table (BERT) or fixed sinusoids (the original Transformer)."""
    position_ids: PositionIds = "sequential"
    """sequential: position i is slot i (BERT); after_padding: non-padding tokens count from pad_token_id + 1
    and padding sits at pad_token_id (RoBERTa, XLM-R, MPNet)."""
    relative_attention_buckets: int = 0
    """Buckets of a relative position bias shared by every layer (MPNet); 0: none."""
    relative_attention_max_distance: int = 128
    """Distance from which relative positions share the last (logarithmic) bucket."""

    invalid: ClassVar[type[ValueError]] = ConfigError

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.d_model % self.num_heads:
            raise ConfigError(f"d_model {self.d_model} is not divisible by num_heads {self.num_heads}")
        if self.type_vocab_size < 0:
            raise ConfigError(f"type_vocab_size must be >= 0, got {self.type_vocab_size}")
        if self.activation not in ("gelu", "gelu_tanh", "relu"):
            raise ConfigError(f"unsupported activation {self.activation!r}")
        if self.position_embedding not in ("learned", "sinusoidal"):
            raise ConfigError(f"unsupported position embedding {self.position_embedding!r}")
        if self.position_ids not in ("sequential", "after_padding"):
            raise ConfigError(f"unsupported position ids {self.position_ids!r}")
        if self.position_ids == "after_padding" and self.max_sequence_positions <= 0:
            raise ConfigError(f"max_positions {self.max_positions} leaves no position after pad_token_id")
        if self.relative_attention_buckets < 0 or self.relative_attention_max_distance <= 0:
            raise ConfigError("relative attention buckets must be >= 0 and their max distance positive")
        self.check_pad_token_id()

    @property
    def head_dim(self) -> int:
        """d_k: the width of one attention head."""
        return self.d_model // self.num_heads

    @property
    def max_sequence_positions(self) -> int:
        """Longest sequence the positions cover (RoBERTa-style ids start after pad_token_id)."""
        if self.position_ids == "after_padding":
            return self.max_positions - self.pad_token_id - 1
        return self.max_positions


ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
HEAD_PREFIXES = ("pooler.", "classifier.", "pre_classifier.", "lm_head.", "vocab_", "cls.")
"""Weights of task heads, kept apart from the encoder's."""
DISTILBERT_SIZE_KEYS = {
    "vocab_size": "vocab_size",
    "d_model": "dim",
    "num_heads": "n_heads",
    "num_layers": "n_layers",
    "ffn_dim": "hidden_dim",
}
"""DistilBERT's config.json keys for the shared sizes."""
MPNET_PADDING_ID = 1
"""MPNet's embeddings take id 1 as padding whatever the config says (its vocabulary pads with 1)."""


JINA_REMOTE_CODE = (
    "jina-embeddings-v3 remote-code form (xlm-roberta with lora_adaptations, XLMRobertaLoRA), which transformers"
    " runs only with trust_remote_code: its transformers-native form (model_type 'jina_embeddings_v3' with one"
    " PEFT adapter folder per task, as jinaai/jina-embeddings-v3-hf) is supported"
)


def _build(**fields: object) -> EncoderConfig:
    try:
        return EncoderConfig(**fields)
    except ConfigError as error:
        raise ArchitectureError(f"config.json: {error}") from error


def _bert_config(hf_config: dict, pooling: str, normalize: bool) -> EncoderConfig:
    shared = read_shared_fields(hf_config, pooling, normalize)
    if "lora_adaptations" in hf_config:
        raise ArchitectureError(f"unsupported {JINA_REMOTE_CODE}")
    if hf_config.get("position_embedding_type", "absolute") != "absolute":
        raise ArchitectureError(f"unsupported position_embedding_type {hf_config['position_embedding_type']!r}")
    if hf_config.get("is_decoder") and hf_config.get("model_type") != "mpnet":  # MPNet's attention ignores it
        raise ArchitectureError("unsupported is_decoder true (causal attention): only bidirectional encoders")
    roberta_style = hf_config.get("model_type") in ("roberta", "xlm-roberta", "mpnet")
    if hf_config.get("model_type") == "mpnet" and hf_config.get("pad_token_id", MPNET_PADDING_ID) != MPNET_PADDING_ID:
        raise ArchitectureError(f"MPNet counts positions after id {MPNET_PADDING_ID}: pad_token_id must be it")
    return _build(
        **shared,
        max_positions=hf_config.get("max_position_embeddings", 512),
        type_vocab_size=hf_config.get("type_vocab_size", 0 if hf_config.get("model_type") == "mpnet" else 2),
        activation=read_activation(hf_config, "hidden_act", ACTIVATIONS, "gelu"),
        layer_norm_eps=hf_config.get("layer_norm_eps", 1e-12),
        position_ids="after_padding" if roberta_style else "sequential",
        relative_attention_buckets=hf_config.get("relative_attention_num_buckets", 0),
    )


def _distilbert_config(hf_config: dict, pooling: str, normalize: bool) -> EncoderConfig:
    return _build(
        **read_shared_fields(hf_config, pooling, normalize, DISTILBERT_SIZE_KEYS),
        max_positions=hf_config.get("max_position_embeddings", 512),
        type_vocab_size=0,
        activation=read_activation(hf_config, "activation", ACTIVATIONS, "gelu"),
    )


_WRAPPERS = ("0.auto_model.", "model.")
_EMBEDDINGS = {**BERT_EMBEDDINGS, "embeddings.position_embeddings": "embeddings.position"}


def _names(prefix: str, layers: str, modules: dict[str, str], others: dict[str, str] = _EMBEDDINGS) -> ModuleRenames:
    """A model type's weight names: its model under `prefix`, its layer list `layers`, a layer's `modules`."""
    return ModuleRenames((prefix, *_WRAPPERS), HEAD_PREFIXES, layers, modules, others, ("position_ids",), True)


_BERT_LAYER = {
    "attention.self.query": "attention.query",
    "attention.self.key": "attention.key",
    "attention.self.value": "attention.value",
    **BERT_ATTENTION_OUTPUT,
    **BERT_FEED_FORWARD,
}
_DISTILBERT_NAMES = _names(
    "distilbert.",
    r"transformer\.layer",
    {
        "attention.q_lin": "attention.query",
        "attention.k_lin": "attention.key",
        "attention.v_lin": "attention.value",
        "attention.out_lin": "attention.output",
        "sa_layer_norm": "attention_norm",
        "ffn.lin1": "feed_forward.inner",
        "ffn.lin2": "feed_forward.outer",
        "output_layer_norm": "output_norm",
    },
)
_MPNET_NAMES = _names(
    "mpnet.",
    r"encoder\.layer",
    {
        "attention.attn.q": "attention.query",
        "attention.attn.k": "attention.key",
        "attention.attn.v": "attention.value",
        "attention.attn.o": "attention.output",
        "attention.LayerNorm": "attention_norm",
        **BERT_FEED_FORWARD,
    },
    {**_EMBEDDINGS, "encoder.relative_attention_bias": "relative_attention_bias"},
)


def _bert_like(model_type: str, prefix: str, classifier_style: str) -> Format:
    names = _names(prefix, r"encoder\.layer", _BERT_LAYER)
    return Format(model_type, _bert_config, names.split, classifier_style)


def sinusoidal_positions(max_positions: int, d_model: int) -> Tensor:
    """The fixed sin/cos position table of "Attention Is All You Need" (d_model may be odd)."""
    positions = torch.arange(max_positions, dtype=torch.float32).unsqueeze(1)
    frequencies = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    table = torch.zeros(max_positions, d_model)
    table[:, 0::2] = torch.sin(positions * frequencies)
    table[:, 1::2] = torch.cos(positions * frequencies[: d_model // 2])
    return table


class Embeddings(nn.Module):
    """Token + position (+ segment) embeddings followed by LayerNorm."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.token = nn.Embedding(config.vocab_size, config.d_model, padding_idx=config.pad_token_id)
        self.position = nn.Embedding(config.max_positions, config.d_model)
        if config.position_embedding == "sinusoidal":
            self.position.weight.data.copy_(sinusoidal_positions(config.max_positions, config.d_model))
            self.position.weight.requires_grad_(False)
        self.segment = SegmentEmbedding(config.type_vocab_size, config.d_model) if config.type_vocab_size else None
        self.norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.pad_token_id = config.pad_token_id
        self.positions_after_padding = config.position_ids == "after_padding"
        self.register_buffer("position_ids", torch.arange(config.max_positions).unsqueeze(0), persistent=False)

    def positions(self, input_ids: Tensor) -> Tensor:
        """Position ids [batch or 1, seq]: slots in order, or (after_padding) counted over non-padding ids."""
        if not self.positions_after_padding:
            return self.position_ids[:, : input_ids.shape[1]]
        real = input_ids.ne(self.pad_token_id).to(torch.int64)
        return torch.cumsum(real, dim=1) * real + self.pad_token_id

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None) -> Tensor:
        """Embed ids [batch, seq] into hidden states [batch, seq, d_model]."""
        hidden = self.token(input_ids) + self.position(self.positions(input_ids))
        if self.segment is not None:
            hidden = hidden + self.segment(input_ids, token_type_ids)
        return self.norm(hidden)


def relative_position_buckets(length: int, num_buckets: int, max_distance: int, device: torch.device) -> Tensor:
    """[length, length] bucket of each key position relative to each query position (T5's, as MPNet uses it).

    Half the buckets are for keys before the query, half after; within each half, the first
    half are exact distances and the rest grow logarithmically up to max_distance.
    """
    positions = torch.arange(length, dtype=torch.int64, device=device)
    distance = positions[:, None] - positions[None, :]  # query - key
    half = num_buckets // 2
    buckets = (distance < 0).to(torch.int64) * half
    distance = distance.abs()
    exact = half // 2
    logarithmic = exact + (torch.log(distance.float() / exact) / math.log(max_distance / exact) * (half - exact)).to(
        torch.int64
    )
    logarithmic = torch.clamp(logarithmic, max=half - 1)
    return buckets + torch.where(distance < exact, distance, logarithmic)


class MultiHeadAttention(nn.Module):
    """Self-attention: Q, K, V projections split into heads, softmax(QKᵀ/√d_k + mask)·V, then W^O."""

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.query = nn.Linear(d_model, d_model)
        self.key = nn.Linear(d_model, d_model)
        self.value = nn.Linear(d_model, d_model)
        self.output = nn.Linear(d_model, d_model)

    def _split_heads(self, projected: Tensor) -> Tensor:
        """[batch, seq, d_model] -> [batch, heads, seq, d_k]."""
        # Size arithmetic as BERT writes it: the traced Shape/Concat pattern the ORT optimiser fuses.
        shape = projected.size()[:-1] + (self.num_heads, self.head_dim)  # noqa: RUF005
        return projected.view(shape).permute(0, 2, 1, 3)

    def forward(self, hidden: Tensor, attention_bias: Tensor) -> Tensor:
        """Attend, adding attention_bias to the scores.

        attention_bias is [batch, 1, 1, seq] (0 where attended, very negative at padding), or
        [batch, heads, seq, seq] with a relative position bias.
        """
        query = self._split_heads(self.query(hidden))
        key = self._split_heads(self.key(hidden))
        value = self._split_heads(self.value(hidden))
        scores = torch.matmul(query, key.transpose(-1, -2)) / math.sqrt(self.head_dim)
        weights = torch.softmax(scores + attention_bias, dim=-1)
        context = torch.matmul(weights, value).permute(0, 2, 1, 3).contiguous()
        concatenated = context.view(context.size()[:-2] + (self.num_heads * self.head_dim,))  # noqa: RUF005
        return self.output(concatenated)


class EncoderLayer(nn.Module):
    """One post-norm layer: x = LN(x + Attention(x)); x = LN(x + FFN(x))."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.attention = MultiHeadAttention(config.d_model, config.num_heads)
        self.attention_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.feed_forward = FeedForward(config.d_model, config.ffn_dim, config.activation)
        self.output_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)

    def forward(self, hidden: Tensor, attention_bias: Tensor) -> Tensor:
        """Transform hidden states [batch, seq, d_model]."""
        hidden = self.attention_norm(hidden + self.attention(hidden, attention_bias))
        return self.output_norm(hidden + self.feed_forward(hidden))


class Encoder(PooledEncoder):
    """The whole encoder: embeddings, S layers, pooling and optional normalisation."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__(config)
        self.embeddings = Embeddings(config)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_layers))
        buckets = config.relative_attention_buckets
        self.relative_attention_bias = nn.Embedding(buckets, config.num_heads) if buckets else None

    def hidden_states(
        self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """The last hidden states [batch, seq, d_model] and the float mask [batch, seq] (task heads start here)."""
        hidden = self.embeddings(input_ids, token_type_ids)
        mask = attention_mask.to(hidden.dtype)
        attention_bias = (1.0 - mask[:, None, None, :]) * torch.finfo(hidden.dtype).min
        if self.relative_attention_bias is not None:
            buckets = relative_position_buckets(
                input_ids.shape[1],
                self.config.relative_attention_buckets,
                self.config.relative_attention_max_distance,
                input_ids.device,
            )
            attention_bias = attention_bias + self.relative_attention_bias(buckets).permute(2, 0, 1).unsqueeze(0)
        for layer in self.layers:
            hidden = layer(hidden, attention_bias)
        return hidden, mask


FAMILY = Family(
    name="bert",
    config_type=EncoderConfig,
    build=Encoder,
    formats=(
        _bert_like("bert", "bert.", "bert"),
        _bert_like("roberta", "roberta.", "roberta"),
        _bert_like("xlm-roberta", "roberta.", "roberta"),
        Format("distilbert", _distilbert_config, _DISTILBERT_NAMES.split, "distilbert"),
        Format("mpnet", _bert_config, _MPNET_NAMES.split, "roberta"),
    ),
    graph_forms=BERT_FUSIONS,
)
"""BERT, RoBERTa, XLM-RoBERTa, DistilBERT and MPNet: one encoder, five readings."""
