"""DeBERTa-v2/v3 from its definition: disentangled attention over relative positions.

Token embeddings (no absolute positions: position_biased_input false), LayerNorm, then zeroed at
padding, feed S post-norm layers as BERT's: x = LN(x + Attention(x)); x = LN(x + FFN(x)), with an
optional convolution beside the first layer (DeBERTa-v2's conv_kernel_size). Positions enter only
through attention. With Q, K the content projections and P the relative position embeddings
(LayerNorm'd when norm_rel_ebd says so), each head's scores are

    (Q·Kᵀ + c2p + p2c) / √(d_k · (1 + number of terms)),
    c2p[i, j] = Q_i · P_k[δ(i, j)]   (content to position: pos_att_type "c2p")
    p2c[i, j] = K_j · P_q[δ'(j, i)]  (position to content: "p2c")

where P_k, P_q are P through the key and query projections (share_att_key) or their own, and
δ(i, j) = clamp(span + bucket(i - j)), δ'(j, i) = clamp(span - bucket(j - i)) index the 2·span
rows of P. bucket is the distance itself, or with position_buckets its log-bucket: exact within
half the buckets, logarithmic up to max_relative_positions beyond. The bucket of every distance
a sequence can hold is tabulated once, in PyTorch, exactly as transformers computes it (its
ceil of a ratio of logarithms sits on an integer at the longest distance, where another
library's log could round the other way); the graph computes i - j from the sequence length
and looks the rows up, so any length up to max_positions runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from export.checkpoints.architecture_error import ArchitectureError
from export.checkpoints.weight_names import BERT_ATTENTION_OUTPUT, BERT_EMBEDDINGS, BERT_FEED_FORWARD, ModuleRenames
from export.families.encoder_config import EncoderConfigBase, read_activation, read_shared_fields
from export.families.family import BERT_FUSIONS, Family, Format
from export.layers.attention import attend
from export.layers.feed_forward import FeedForward, activate
from export.layers.pooling import PooledEncoder
from export.layers.segments import SegmentEmbedding

ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
    "tanh": "tanh",
}
"""Hugging Face activation names -> ours (hidden_act, conv_act)."""
ATTENTION_TERMS = ("c2p", "p2c")
NORM_REL_EBD = ("none", "layer_norm")
HEAD_PREFIXES = ("pooler.", "classifier.", "lm_predictions.", "mask_predictions.", "cls.")
"""Task-head weights (classification, masked-LM and replaced-token heads), set apart from the encoder's."""
UNUSED_POSITION_TABLE = "embeddings.position_embeddings.weight"
"""An absolute position table some checkpoints carry with position_biased_input false; transformers ignores it too."""


@dataclass(frozen=True, kw_only=True)
class DebertaConfig(EncoderConfigBase):
    """Hyper-parameters of a DeBERTa-v2/v3 encoder, validated on construction."""

    max_positions: int = 512
    """Longest sequence: the relative distances are tabulated up to it."""
    type_vocab_size: int = 0
    """Segment ids; 0: none (DeBERTa-v3); 1: one row added to every token, no input."""
    activation: str = "gelu"
    layer_norm_eps: float = 1e-7
    relative_attention: bool = True
    attention_terms: tuple[str, ...] = ATTENTION_TERMS
    """pos_att_type: which of c2p and p2c are added to the scores (they count in the scale even without
    relative_attention, as in transformers)."""
    position_buckets: int = 256
    """Log-bucketed distances when > 0; 0: distances as they are."""
    max_relative_positions: int = 512
    share_att_key: bool = True
    """Position embeddings projected by the content query and key (True) or by their own projections."""
    norm_rel_embeddings: bool = True
    """norm_rel_ebd "layer_norm": a LayerNorm over the relative position embeddings."""
    conv_kernel_size: int = 0
    """The convolution beside the first layer (DeBERTa-v2 xlarge); 0: none."""
    conv_groups: int = 1
    conv_activation: str = "tanh"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_positive(("max_relative_positions", "conv_groups"))
        if self.d_model % self.num_heads:
            raise ArchitectureError(f"hidden_size {self.d_model} is not divisible by num_attention_heads")
        unknown = [term for term in self.attention_terms if term not in ATTENTION_TERMS]
        if unknown or len(set(self.attention_terms)) != len(self.attention_terms):
            raise ArchitectureError(f"unsupported pos_att_type {self.attention_terms!r} (supported: c2p, p2c)")
        for name in ("activation", "conv_activation"):
            if getattr(self, name) not in ACTIVATIONS.values():
                raise ArchitectureError(f"unsupported {name} {getattr(self, name)!r}")
        if self.position_buckets < 0 or self.type_vocab_size < 0:
            raise ArchitectureError("position_buckets and type_vocab_size must be >= 0")
        if self.position_buckets and self.position_buckets < 4:
            raise ArchitectureError(f"position_buckets {self.position_buckets}: at least 4 for log buckets")
        if self.conv_kernel_size and (self.conv_kernel_size % 2 == 0 or self.d_model % self.conv_groups):
            raise ArchitectureError(
                f"conv_kernel_size {self.conv_kernel_size} / conv_groups {self.conv_groups}: an odd kernel"
                " (an even one changes the sequence length) over groups that divide hidden_size"
            )
        self.check_pad_token_id()

    @property
    def head_dim(self) -> int:
        """d_k: the width of one attention head."""
        return self.d_model // self.num_heads

    @property
    def attention_span(self) -> int:
        """Half the rows of the relative position embeddings: position_buckets, or max_relative_positions."""
        return self.position_buckets or self.max_relative_positions

    @property
    def scale_factor(self) -> int:
        """The scores are divided by √(d_k · this): one for content, one for each position term."""
        return 1 + len(self.attention_terms)


def _refuse_unimplemented(hf_config: dict) -> None:
    """One line for each config value this encoder does not implement."""
    if hf_config.get("position_biased_input", True):
        raise ArchitectureError("unsupported position_biased_input true: absolute positions (DeBERTa-v1 style)")
    hidden = hf_config["hidden_size"]
    if hf_config.get("embedding_size", hidden) != hidden:
        raise ArchitectureError(f"unsupported embedding_size {hf_config['embedding_size']} (only hidden_size {hidden})")
    width = hidden // hf_config["num_attention_heads"]
    if hf_config.get("attention_head_size", width) != width:
        raise ArchitectureError(f"unsupported attention_head_size {hf_config['attention_head_size']} (only {width})")
    if hf_config.get("z_steps", 0) > 1:
        raise ArchitectureError(f"unsupported z_steps {hf_config['z_steps']}")


def config_from_hf(hf_config: dict, pooling: str, normalize: bool) -> DebertaConfig:
    """Translate a Hugging Face DeBERTa-v2 config.json (DeBERTa-v3 uses the same model_type)."""
    shared = read_shared_fields(hf_config, pooling, normalize)
    _refuse_unimplemented(hf_config)
    terms = hf_config.get("pos_att_type") or ()
    if isinstance(terms, str):
        terms = [term.strip() for term in terms.lower().split("|")]
    norm = [part.strip() for part in str(hf_config.get("norm_rel_ebd", "none")).lower().split("|")]
    if any(part not in NORM_REL_EBD for part in norm):
        raise ArchitectureError(f"unsupported norm_rel_ebd {hf_config['norm_rel_ebd']!r} (supported: layer_norm, none)")
    max_positions = hf_config.get("max_position_embeddings", 512)
    max_relative = hf_config.get("max_relative_positions", -1)
    return DebertaConfig(
        **shared,
        max_positions=max_positions,
        type_vocab_size=hf_config.get("type_vocab_size", 0),
        activation=read_activation(hf_config, "hidden_act", ACTIVATIONS, "gelu"),
        layer_norm_eps=hf_config.get("layer_norm_eps", 1e-7),
        relative_attention=bool(hf_config.get("relative_attention", False)),
        attention_terms=tuple(terms),
        position_buckets=max(hf_config.get("position_buckets", -1), 0),
        max_relative_positions=max_relative if max_relative >= 1 else max_positions,
        share_att_key=bool(hf_config.get("share_att_key", False)),
        norm_rel_embeddings="layer_norm" in norm,
        conv_kernel_size=max(hf_config.get("conv_kernel_size", 0), 0),
        conv_groups=hf_config.get("conv_groups", 1),
        conv_activation=read_activation(hf_config, "conv_act", ACTIVATIONS, "tanh"),
    )


rename_weights = ModuleRenames(
    ("deberta.", "0.auto_model.", "model."),
    HEAD_PREFIXES,
    r"encoder\.layer",
    {
        "attention.self.query_proj": "attention.query",
        "attention.self.key_proj": "attention.key",
        "attention.self.value_proj": "attention.value",
        "attention.self.pos_key_proj": "attention.position_key",
        "attention.self.pos_query_proj": "attention.position_query",
        **BERT_ATTENTION_OUTPUT,
        **BERT_FEED_FORWARD,
    },
    {
        **BERT_EMBEDDINGS,
        "encoder.rel_embeddings": "relative_embeddings",
        "encoder.LayerNorm": "relative_norm",
        "encoder.conv.conv": "conv.conv",
        "encoder.conv.LayerNorm": "conv.norm",
    },
    unread=("position_ids", UNUSED_POSITION_TABLE),  # position_biased_input true is refused: the table is not read
).split
"""DeBERTa-v2's parameter names -> this module's, and the task heads' weights apart."""


def relative_buckets(distances: Tensor, buckets: int, max_distance: int) -> Tensor:
    """The bucket of each relative distance (query - key): exact below buckets / 2, log-spaced beyond.

    Computed with transformers' operations in float32, so that the ceil lands where it does there.
    """
    middle = buckets // 2
    sign = torch.sign(distances)
    near = (distances < middle) & (distances > -middle)
    magnitude = torch.where(near, torch.tensor(middle - 1).type_as(distances), torch.abs(distances))
    ratio = torch.log(magnitude / middle) / torch.log(torch.tensor((max_distance - 1) / middle))
    logarithmic = torch.ceil(ratio * (middle - 1)) + middle
    return torch.where(magnitude <= middle, distances.type_as(logarithmic), logarithmic * sign).to(torch.int64)


@dataclass(frozen=True)
class Relative:
    """What every layer's position terms read: the embeddings and, per (query, key), their row in it."""

    embeddings: Tensor
    """The relative position embeddings [1, 2·span, d_model] (LayerNorm'd with norm_rel_ebd)."""
    c2p_rows: Tensor
    """[seq, seq]: the row for query i and key j, clamp(span + bucket(i - j))."""
    p2c_rows: Tensor
    """[seq, seq]: the row for key i and query j, clamp(span - bucket(i - j)) (transposed after gathering)."""


class Embeddings(nn.Module):
    """Token (+ segment) embeddings, LayerNorm, then zero at padding positions."""

    def __init__(self, config: DebertaConfig) -> None:
        super().__init__()
        self.token = nn.Embedding(config.vocab_size, config.d_model, padding_idx=config.pad_token_id)
        self.segment = SegmentEmbedding(config.type_vocab_size, config.d_model) if config.type_vocab_size else None
        self.norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None, mask: Tensor) -> Tensor:
        """Embed ids [batch, seq] into [batch, seq, d_model]; mask is the float attention mask [batch, seq]."""
        hidden = self.token(input_ids)
        if self.segment is not None:
            hidden = hidden + self.segment(input_ids, token_type_ids)
        return self.norm(hidden) * mask.unsqueeze(-1)


class DisentangledAttention(nn.Module):
    """Multi-head attention whose scores add content-to-position and position-to-content terms."""

    def __init__(self, config: DebertaConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.terms = config.attention_terms if config.relative_attention else ()
        self.scale = math.sqrt(config.head_dim * config.scale_factor)
        self.query = nn.Linear(config.d_model, config.d_model)
        self.key = nn.Linear(config.d_model, config.d_model)
        self.value = nn.Linear(config.d_model, config.d_model)
        self.output = nn.Linear(config.d_model, config.d_model)
        own = not config.share_att_key
        self.position_key = nn.Linear(config.d_model, config.d_model) if own and "c2p" in self.terms else None
        self.position_query = nn.Linear(config.d_model, config.d_model) if own and "p2c" in self.terms else None

    def _heads(self, projected: Tensor) -> Tensor:
        """[..., seq, d_model] -> [..., heads, seq, d_k]."""
        split = projected.view(*projected.shape[:-1], self.num_heads, self.head_dim)
        return split.transpose(-2, -3)

    def forward(self, hidden: Tensor, key_bias: Tensor, relative: Relative | None) -> Tensor:
        """Attend over hidden [batch, seq, d_model].

        key_bias: [batch, 1, 1, seq], 0 where attended, very negative at padding; relative: the
        position embeddings and their rows (None without relative attention).
        """
        query, key, value = (
            self._heads(self.query(hidden)),
            self._heads(self.key(hidden)),
            self._heads(self.value(hidden)),
        )
        scores = torch.matmul(query, key.transpose(-1, -2) / self.scale)
        batch, heads, length = query.shape[0], query.shape[1], query.shape[2]
        if relative is not None and "c2p" in self.terms:
            projection = self.key if self.position_key is None else self.position_key
            c2p = torch.matmul(query, self._heads(projection(relative.embeddings)).transpose(-1, -2))
            index = relative.c2p_rows.expand(batch, heads, length, length)  # c2p: [batch, heads, seq, 2·span]
            scores = scores + torch.gather(c2p, -1, index) / self.scale
        if relative is not None and "p2c" in self.terms:
            projection = self.query if self.position_query is None else self.position_query
            p2c = torch.matmul(key, self._heads(projection(relative.embeddings)).transpose(-1, -2))
            index = relative.p2c_rows.expand(batch, heads, length, length)  # p2c: [batch, heads, key, 2·span]
            scores = scores + torch.gather(p2c, -1, index).transpose(-1, -2) / self.scale
        context = attend(scores, key_bias, value, batch, length)
        return self.output(context)


class Layer(nn.Module):
    """One post-norm layer: x = LN(x + Attention(x)); x = LN(x + FFN(x))."""

    def __init__(self, config: DebertaConfig) -> None:
        super().__init__()
        self.attention = DisentangledAttention(config)
        self.attention_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.feed_forward = FeedForward(config.d_model, config.ffn_dim, config.activation)
        self.output_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)

    def forward(self, hidden: Tensor, key_bias: Tensor, relative: Relative | None) -> Tensor:
        """Transform hidden states [batch, seq, d_model]."""
        hidden = self.attention_norm(hidden + self.attention(hidden, key_bias, relative))
        return self.output_norm(hidden + self.feed_forward(hidden))


class Convolution(nn.Module):
    """DeBERTa-v2's convolution over the embeddings, added to the first layer's output: LN(x + act(conv(e))) · mask."""

    def __init__(self, config: DebertaConfig) -> None:
        super().__init__()
        size = config.conv_kernel_size
        self.conv = nn.Conv1d(config.d_model, config.d_model, size, padding=(size - 1) // 2, groups=config.conv_groups)
        self.norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.activation = config.conv_activation

    def forward(self, embedded: Tensor, hidden: Tensor, mask: Tensor) -> Tensor:
        """embedded: the embeddings [batch, seq, d_model]; hidden: the first layer's output; mask [batch, seq]."""
        convolved = self.conv(embedded.transpose(1, 2)).transpose(1, 2) * mask.unsqueeze(-1)
        return self.norm(hidden + activate(self.activation, convolved)) * mask.unsqueeze(-1)


class DebertaEncoder(PooledEncoder):
    """The whole encoder: embeddings, S layers of disentangled attention (and the convolution), pooling."""

    def __init__(self, config: DebertaConfig) -> None:
        super().__init__(config)
        self.embeddings = Embeddings(config)
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.num_layers))
        relative = config.relative_attention
        self.relative_embeddings = nn.Embedding(2 * config.attention_span, config.d_model) if relative else None
        # Checkpoints carry this LayerNorm whenever norm_rel_ebd says so, read or not (no relative attention).
        norm = config.norm_rel_embeddings
        self.relative_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) if norm else None
        self.conv = Convolution(config) if config.conv_kernel_size else None
        longest = config.max_positions - 1
        distances = torch.arange(-longest, longest + 1, dtype=torch.int64)
        if config.position_buckets:
            distances = relative_buckets(distances, config.position_buckets, config.max_relative_positions)
        span = config.attention_span
        # Row of the position embeddings for each distance (query - key), from -longest at index 0.
        self.register_buffer("c2p_rows", torch.clamp(distances + span, 0, 2 * span - 1), persistent=False)
        self.register_buffer("p2c_rows", torch.clamp(-distances + span, 0, 2 * span - 1), persistent=False)

    def _relative(self, length_of: Tensor) -> Relative | None:
        """The position embeddings and the c2p and p2c rows [seq, seq] for length_of's sequence length."""
        if self.relative_embeddings is None:
            return None
        embeddings = self.relative_embeddings.weight
        if self.relative_norm is not None:
            embeddings = self.relative_norm(embeddings)
        positions = torch.arange(length_of.shape[1], device=length_of.device)
        distances = positions[:, None] - positions[None, :] + (self.config.max_positions - 1)
        # [1, 2·span, d_model]: projected by MatMul, as transformers does it; a 2-D Linear exports as Gemm,
        # whose fp16 form crashes ONNX Runtime's CPU session at its default optimisation level (NchwcTransformer).
        return Relative(embeddings.unsqueeze(0), self.c2p_rows[distances], self.p2c_rows[distances])

    def hidden_states(
        self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """The last hidden states [batch, seq, d_model] and the float mask [batch, seq] (task heads start here)."""
        mask = attention_mask.to(self.embeddings.norm.weight.dtype)
        embedded = self.embeddings(input_ids, token_type_ids, mask)
        key_bias = (1.0 - mask[:, None, None, :]) * torch.finfo(embedded.dtype).min
        relative = self._relative(input_ids)
        hidden = embedded
        for index, layer in enumerate(self.layers):
            hidden = layer(hidden, key_bias, relative)
            if index == 0 and self.conv is not None:
                hidden = self.conv(embedded, hidden, mask)
        return hidden, mask


FAMILY = Family(
    name="deberta",
    config_type=DebertaConfig,
    build=DebertaEncoder,
    formats=(Format("deberta-v2", config_from_hf, rename_weights, "deberta"),),
    graph_forms=BERT_FUSIONS,
)
"""DeBERTa-v2 and -v3."""
