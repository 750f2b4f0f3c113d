"""The pre-norm Transformer layer of CLIP's and SigLIP's towers, and what their image and text towers share.

Both families' image and text towers stack the same layer: x = x + Attention(LN₁(x)); x = x + MLP(LN₂(x)),
where Attention is multi-head self-attention, softmax(QKᵀ/√d_k + bias)·V (softmax in fp32), then W^O, and
the MLP is fc2(act(fc1(x))) with the activation the config names (CLIP's quick_gelu, x·sigmoid(1.702x);
SigLIP's tanh-approximated GELU). An image enters as non-overlapping patches: a convolution with kernel and
stride the patch size, one token per patch in row-major order, plus a learned position embedding each. A
text enters as token plus learned position embeddings and leaves the layers through a final LayerNorm.
Modules are named as transformers names them (self_attn.q_proj, layer_norm1, mlp.fc1, ...), so a layer's
weights load unrenamed. Each tower is one graph (export.graph.towers): its inputs, output and dynamic axes
are declared here.
"""

from __future__ import annotations

from collections.abc import Callable
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


def embedding_output(vector: Tensor, normalize: bool) -> Tensor:
    """A tower's embedding [batch, width], L2-normalised if asked."""
    return F.normalize(vector, p=2.0, dim=-1) if normalize else vector


class ImageTower(nn.Module):
    """A vision tower's patch and position embeddings, and its graph: pixel values in, one embedding a row out.

    extra_positions: position embeddings before the patches' (CLIP's class token: 1).
    """

    input_names = ("pixel_values",)
    output_names = ("embedding",)
    dynamic_axes: ClassVar[dict[str, dict[int, str]]] = {"pixel_values": {0: "batch"}, "embedding": {0: "batch"}}

    def __init__(
        self, geometry: ImageGeometry, tower: TowerConfig, *, patch_bias: bool, extra_positions: int, normalize: bool
    ) -> None:
        super().__init__()
        self.geometry, self.normalize = geometry, normalize
        self.patch_embedding = nn.Conv2d(
            geometry.num_channels, tower.d_model, geometry.patch_size, stride=geometry.patch_size, bias=patch_bias
        )
        self.position_embedding = nn.Embedding(extra_positions + geometry.num_patches, tower.d_model)
        self.layers = layer_stack(tower)

    def patches(self, pixel_values: Tensor) -> Tensor:
        """Pixel values [batch, channels, H, W] -> one token per patch [batch, patches, d_model], row by row."""
        return self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)

    def example_inputs(self, batch: int) -> tuple[Tensor, ...]:
        """Inputs to trace the tower with: batch images of the size it takes."""
        size = self.geometry.image_size
        return (torch.zeros(batch, self.geometry.num_channels, size, size),)


class TextTower(nn.Module):
    """A text tower's embeddings, layers and final LayerNorm, and its graph: ids and mask in, one embedding a row out.

    The family picks a token's final state and projects it (projection: width and bias).
    """

    input_names = ("input_ids", "attention_mask")
    output_names = ("embedding",)
    dynamic_axes: ClassVar[dict[str, dict[int, str]]] = {
        "input_ids": {0: "batch", 1: "sequence"},
        "attention_mask": {0: "batch", 1: "sequence"},
        "embedding": {0: "batch"},
    }

    def __init__(
        self,
        tower: TowerConfig,
        *,
        vocab_size: int,
        max_positions: int,
        projection: tuple[int, bool],
        normalize: bool,
    ) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, tower.d_model)
        self.position_embedding = nn.Embedding(max_positions, tower.d_model)
        self.layers = layer_stack(tower)
        self.final_norm = nn.LayerNorm(tower.d_model, eps=tower.layer_norm_eps)
        width, bias = projection
        self.projection = nn.Linear(tower.d_model, width, bias=bias)
        self.normalize = normalize

    def final_states(self, input_ids: Tensor, allowed: Tensor) -> Tensor:
        """The final LayerNorm's states [batch, seq, d_model]; allowed [batch, 1, seq|1, seq]: what a query reads."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        hidden = self.token_embedding(input_ids) + self.position_embedding(positions)
        return self.final_norm(run_layers(self.layers, hidden, attention_bias(allowed, hidden.dtype)))

    def embedding(self, states: Tensor) -> Tensor:
        """Each row's chosen final state [batch, d_model] projected (and L2-normalised if asked)."""
        return embedding_output(self.projection(states), self.normalize)

    def example_inputs(self, batch: int) -> tuple[Tensor, ...]:
        """Inputs to trace the tower with: batch rows of 8 tokens, all attended."""
        ones = torch.ones(batch, 8, dtype=torch.int64)
        return ones, ones


class TwoTowerModel(nn.Module):
    """Both towers of a two-tower model (CLIP, SigLIP), each exported as its own graph (export.graph.towers)."""

    def __init__(self, config: object, vision: ImageTower, text: TextTower) -> None:
        super().__init__()
        self.config = config
        """The family's configuration."""
        self.vision = vision
        self.text = text
