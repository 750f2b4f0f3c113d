"""The pre-norm Transformer layer of CLIP's and SigLIP's towers, and the reading of a tower's config section.

Both families' image and text towers stack the same layer: x = x + Attention(LN₁(x)); x = x + MLP(LN₂(x)),
where Attention is multi-head self-attention, softmax(QKᵀ/√d_k + bias)·V (softmax in fp32), then W^O, and
the MLP is fc2(act(fc1(x))) with the activation the config names (CLIP's quick_gelu, x·sigmoid(1.702x); SigLIP's
tanh-approximated GELU). An image enters as non-overlapping patches: a convolution with kernel and stride
the patch size, one token per patch in row-major order. Modules are named as transformers names them
(self_attn.q_proj, layer_norm1, mlp.fc1, ...), so a layer's weights load unrenamed.

A tower's config section is read key by key: the keys a tower reads, the ones only training uses, and the
bookkeeping every transformers config carries are known; any other key is refused by name, never ignored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from export.checkpoints.architecture_error import ArchitectureError


def quick_gelu(values: Tensor) -> Tensor:
    """CLIP's GELU approximation: x·sigmoid(1.702x)."""
    return values * torch.sigmoid(1.702 * values)


def _gelu(values: Tensor) -> Tensor:
    return F.gelu(values)


def _gelu_tanh(values: Tensor) -> Tensor:
    return F.gelu(values, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "quick_gelu": quick_gelu,
    "gelu": _gelu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_new": _gelu_tanh,
}
"""config.json's hidden_act -> the function (gelu_new is the tanh approximation written out)."""
TRAINING_KEYS = frozenset({"attention_dropout", "dropout", "initializer_range", "initializer_factor"})
"""Keys that change training only (dropout is off and initial weights are replaced at inference)."""
BOOKKEEPING_KEYS = frozenset(
    {
        "_name_or_path", "architectures", "dtype", "torch_dtype", "transformers_version", "model_type",
        "id2label", "label2id", "problem_type", "finetuning_task", "task_specific_params", "tokenizer_class",
        "prefix", "return_dict", "output_attentions", "output_hidden_states", "output_scores", "torchscript",
        "use_bfloat16", "tf_legacy_loss", "pruned_heads", "chunk_size_feed_forward", "is_encoder_decoder",
        "is_decoder", "add_cross_attention", "cross_attention_hidden_size", "tie_encoder_decoder",
        "tie_word_embeddings", "bos_token_id", "sep_token_id", "decoder_start_token_id", "max_length",
        "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
        "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty",
        "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences",
        "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
        "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "gradient_checkpointing",
        "_attn_implementation", "_attn_implementation_autoset", "use_cache",
    }
)  # fmt: skip
"""Keys transformers writes into every config (labels, generation settings, versions), which no tower reads.

is_decoder and add_cross_attention are checked apart (false only) where a family reads a section."""
LAYER_KEYS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size")
"""The keys every tower's layers are built from."""


def check_keys(section: dict, where: str, understood: Iterable[str]) -> None:
    """ArchitectureError naming the first key of a config section that is neither understood nor bookkeeping.

    Also refuses a section that declares itself a decoder or cross-attending (is_decoder, add_cross_attention).
    """
    known = set(understood) | TRAINING_KEYS | BOOKKEEPING_KEYS
    unknown = sorted(key for key in section if key not in known)
    if unknown:
        raise ArchitectureError(f"unsupported {where} key {unknown[0]!r} (={section[unknown[0]]!r})")
    for flag in ("is_decoder", "add_cross_attention"):
        if section.get(flag):
            raise ArchitectureError(f"unsupported {where} {flag} true")


def positive_int(section: dict, key: str, where: str, default: object = None) -> int:
    """section[key] (default where absent) as a positive integer, or an ArchitectureError naming it."""
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ArchitectureError(f"{where} {key} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class TowerConfig:
    """The layers of one tower: widths, depth, activation; validated on construction."""

    d_model: int
    """Width of every hidden state."""
    num_heads: int
    """Attention heads per layer; each has d_k = d_model / num_heads."""
    num_layers: int
    ffn_dim: int
    """Inner width of the MLP."""
    activation: str
    """A key of ACTIVATIONS."""
    layer_norm_eps: float

    def __post_init__(self) -> None:
        if self.d_model % self.num_heads:
            raise ArchitectureError(
                f"hidden_size {self.d_model} is not divisible by num_attention_heads {self.num_heads}"
            )
        if self.activation not in ACTIVATIONS:
            raise ArchitectureError(f"unsupported hidden_act {self.activation!r} (supported: {', '.join(ACTIVATIONS)})")

    @property
    def head_dim(self) -> int:
        """d_k: the width of one attention head."""
        return self.d_model // self.num_heads


def read_tower(section: dict, where: str, defaults: dict[str, object]) -> TowerConfig:
    """A tower's layers from its config section; defaults: the family's values for keys the section leaves out.

    An ArchitectureError names the section (where) and the key.
    """
    sizes = [positive_int(section, key, where, defaults.get(key)) for key in LAYER_KEYS]
    activation = section.get("hidden_act", defaults["hidden_act"])
    eps = section.get("layer_norm_eps", defaults["layer_norm_eps"])
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps <= 0:
        raise ArchitectureError(f"{where} layer_norm_eps must be a positive number, got {eps!r}")
    try:
        return TowerConfig(*sizes, activation=activation, layer_norm_eps=float(eps))
    except ArchitectureError as error:
        raise ArchitectureError(f"{where}: {error}") from error


class SelfAttention(nn.Module):
    """Multi-head self-attention: softmax(QKᵀ/√d_k + bias)·V in fp32, heads concatenated, then W^O."""

    def __init__(self, config: TowerConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.q_proj = nn.Linear(config.d_model, config.d_model)
        self.k_proj = nn.Linear(config.d_model, config.d_model)
        self.v_proj = nn.Linear(config.d_model, config.d_model)
        self.out_proj = nn.Linear(config.d_model, config.d_model)

    def _heads(self, states: Tensor) -> Tensor:
        """[batch, seq, d_model] -> [batch, heads, seq, d_k]."""
        return states.view(states.shape[0], states.shape[1], self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, hidden: Tensor, attention_bias: Tensor | None) -> Tensor:
        """Attend over hidden [batch, seq, d_model]; attention_bias broadcasts to [batch, heads, seq, seq], or None."""
        query, key, value = (self._heads(project(hidden)) for project in (self.q_proj, self.k_proj, self.v_proj))
        scores = torch.matmul(query, key.transpose(-1, -2)) * self.head_dim**-0.5
        if attention_bias is not None:
            scores = scores + attention_bias
        weights = torch.softmax(scores.to(torch.float32), dim=-1).to(hidden.dtype)
        context = torch.matmul(weights, value).transpose(1, 2)
        return self.out_proj(context.reshape(hidden.shape[0], hidden.shape[1], -1))


class MLP(nn.Module):
    """fc2(act(fc1(x))), applied to every position."""

    def __init__(self, config: TowerConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.d_model, config.ffn_dim)
        self.fc2 = nn.Linear(config.ffn_dim, config.d_model)
        self.activation = ACTIVATIONS[config.activation]

    def forward(self, hidden: Tensor) -> Tensor:
        """Transform hidden [..., d_model]."""
        return self.fc2(self.activation(self.fc1(hidden)))


class PreNormLayer(nn.Module):
    """x = x + Attention(LN₁(x)); x = x + MLP(LN₂(x))."""

    def __init__(self, config: TowerConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.self_attn = SelfAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.mlp = MLP(config)

    def forward(self, hidden: Tensor, attention_bias: Tensor | None) -> Tensor:
        """Transform hidden states [batch, seq, d_model]."""
        hidden = hidden + self.self_attn(self.layer_norm1(hidden), attention_bias)
        return hidden + self.mlp(self.layer_norm2(hidden))


def layer_stack(config: TowerConfig) -> nn.ModuleList:
    """The tower's num_layers layers."""
    return nn.ModuleList(PreNormLayer(config) for _ in range(config.num_layers))


def run_layers(layers: nn.ModuleList, hidden: Tensor, attention_bias: Tensor | None) -> Tensor:
    """Hidden states [batch, seq, d_model] through every layer, each with the same attention bias."""
    for layer in layers:
        hidden = layer(hidden, attention_bias)
    return hidden


def attention_bias(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """The additive bias: 0 where a query may read a key (allowed), the dtype's minimum elsewhere."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


def patch_tokens(patch_embedding: nn.Conv2d, pixel_values: Tensor) -> Tensor:
    """Pixel values [batch, channels, H, W] -> one token per patch [batch, patches, d_model], row by row."""
    return patch_embedding(pixel_values).flatten(2).transpose(1, 2)


@dataclass(frozen=True)
class ImageGeometry:
    """The image a vision tower takes: square, image_size pixels a side, cut into patch_size squares."""

    image_size: int
    patch_size: int
    num_channels: int

    @property
    def num_patches(self) -> int:
        """Patches per image (a remainder of pixels past the last whole patch is not read, as in the model)."""
        return (self.image_size // self.patch_size) ** 2


def read_geometry(section: dict, where: str, defaults: dict[str, object]) -> ImageGeometry:
    """image_size, patch_size (integers: one side of a square) and num_channels of a vision config section."""
    geometry = ImageGeometry(
        *(positive_int(section, key, where, defaults.get(key)) for key in ("image_size", "patch_size", "num_channels"))
    )
    if geometry.patch_size > geometry.image_size:
        raise ArchitectureError(f"{where} patch_size {geometry.patch_size} exceeds image_size {geometry.image_size}")
    return geometry


def embedding_output(vector: Tensor, normalize: bool) -> Tensor:
    """A tower's embedding [batch, width], L2-normalised if asked."""
    return F.normalize(vector, p=2.0, dim=-1) if normalize else vector


class ImageTower(nn.Module):
    """A vision tower's graph interface: pixel values [batch, channels, H, W] in, one embedding a row out."""

    input_names = ("pixel_values",)
    output_names = ("embedding",)
    dynamic_axes: ClassVar[dict[str, dict[int, str]]] = {"pixel_values": {0: "batch"}, "embedding": {0: "batch"}}

    def __init__(self, geometry: ImageGeometry) -> None:
        super().__init__()
        self.geometry = geometry

    def example_inputs(self, batch: int) -> tuple[Tensor, ...]:
        """Inputs to trace the tower with: batch images of the size it takes."""
        size = self.geometry.image_size
        return (torch.zeros(batch, self.geometry.num_channels, size, size),)


class TextTower(nn.Module):
    """A text tower's graph interface: input_ids and attention_mask [batch, seq] in, one embedding a row out."""

    input_names = ("input_ids", "attention_mask")
    output_names = ("embedding",)
    dynamic_axes: ClassVar[dict[str, dict[int, str]]] = {
        "input_ids": {0: "batch", 1: "sequence"},
        "attention_mask": {0: "batch", 1: "sequence"},
        "embedding": {0: "batch"},
    }

    def example_inputs(self, batch: int) -> tuple[Tensor, ...]:
        """Inputs to trace the tower with: batch rows of 8 tokens, all attended."""
        ones = torch.ones(batch, 8, dtype=torch.int64)
        return ones, ones


def rename_weights(
    weights: dict[str, Tensor], renames: dict[str, str], heads: tuple[str, ...], position_ids: tuple[str, ...]
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """A two-tower checkpoint's weights under the towers' names, and its scoring weights (heads) apart.

    renames: checkpoint prefix -> ours. position_ids: buffers older checkpoints saved (0, 1, 2, ...),
    checked and dropped. Any other weight is refused by name.
    """
    towers: dict[str, Tensor] = {}
    head_weights: dict[str, Tensor] = {}
    for name, tensor in weights.items():
        if name in heads:
            head_weights[name] = tensor
        elif name in position_ids:
            if not torch.equal(tensor.reshape(-1).to(torch.int64), torch.arange(tensor.numel())):
                raise ArchitectureError(f"{name} is not the positions 0, 1, 2, ... in order")
        else:
            prefix = next((prefix for prefix in renames if name.startswith(prefix)), None)
            if prefix is None:
                raise ArchitectureError(f"unexpected weight {name!r}")
            towers[renames[prefix] + name[len(prefix) :]] = tensor
    return towers, head_weights
