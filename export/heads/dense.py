"""sentence-transformers' Dense modules after Pooling (EmbeddingGemma's projection), in the graph before Normalize.

A Dense module maps the pooled sentence embedding through a linear layer and its activation
(`out = activation(x·Wᵀ + b)`). EmbeddingGemma chains two (768 -> 3072 -> 768, identity
activation, no bias) between mean pooling and Normalize. The exporter implements the identity
activation only, without the residual option, and a chain that ends at the encoder's hidden size
(the server serves the embedding and the token states at one width); anything else is refused in
one line naming the module's file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from export.heads.head import Head, HeadFolder, HeadWeights, UnreadableHead, embedder_outputs
from export.layers.pooling import pool
from service.core.repository import P_POOLED_PROJECTION

DENSE_FIELDS = {
    "in_features",
    "out_features",
    "bias",
    "activation_function",
    "module_input_name",
    "module_output_name",
    "use_residual",
}
"""A Dense config.json's fields (sentence-transformers 6.2), each read and checked here."""
IDENTITY_ACTIVATION = "torch.nn.modules.linear.Identity"
"""The one Dense activation implemented, as sentence-transformers names nn.Identity."""
SENTENCE_EMBEDDING = "sentence_embedding"


class DenseError(UnreadableHead):
    """A Dense module the exporter does not implement; the message names the file and field."""


@dataclass(frozen=True)
class DenseLayer:
    """One Dense module: a linear map of the pooled embedding with the identity activation."""

    in_features: int
    out_features: int
    bias: bool


@dataclass(frozen=True)
class DenseConfig:
    """The Dense modules between Pooling and Normalize, in order."""

    layers: tuple[DenseLayer, ...]

    def to_dict(self) -> dict[str, object]:
        """Plain-data form, for parity.json."""
        return {
            "style": "dense",
            "layers": [
                {"in_features": layer.in_features, "out_features": layer.out_features, "bias": layer.bias}
                for layer in self.layers
            ],
        }


def dense_layer(path: Path, settings: dict, in_features: int) -> DenseLayer:
    """One Dense config.json (path, its fields settings), checked; in_features is the width coming in."""
    unknown = sorted(set(settings) - DENSE_FIELDS)
    if unknown:
        raise DenseError(f"{path}: Dense field {unknown[0]!r} is not implemented here")
    activation = settings.get("activation_function", "torch.nn.modules.activation.Tanh")  # the library's default
    if activation != IDENTITY_ACTIVATION:
        raise DenseError(
            f"{path}: Dense activation_function {activation!r} is not supported (only {IDENTITY_ACTIVATION})"
        )
    if settings.get("use_residual", False) is not False:
        raise DenseError(f"{path}: Dense use_residual {settings['use_residual']!r} is not supported (only false)")
    for key in ("module_input_name", "module_output_name"):
        if settings.get(key, SENTENCE_EMBEDDING) not in (SENTENCE_EMBEDDING, None):
            raise DenseError(f"{path}: Dense {key} {settings[key]!r} is not supported (only {SENTENCE_EMBEDDING!r})")
    declared_in, out_features = settings.get("in_features"), settings.get("out_features")
    bias = settings.get("bias", True)
    if type(declared_in) is not int or type(out_features) is not int or out_features <= 0 or type(bias) is not bool:
        raise DenseError(f"{path}: Dense in_features, out_features and bias must be integers and true or false")
    if declared_in != in_features:
        raise DenseError(f"{path}: Dense in_features {declared_in} is not the width coming in, {in_features}")
    return DenseLayer(declared_in, out_features, bias)


def check_width(path: Path, config: DenseConfig, d_model: int) -> None:
    """The chain must end at the encoder's hidden size (the server answers both at one width)."""
    width = config.layers[-1].out_features
    if width != d_model:
        raise DenseError(
            f"{path}: Dense out_features {width} ends the chain at a width other than the hidden size {d_model}:"
            " not supported"
        )


def layer_weights(path: Path, weights: dict[str, Tensor], index: int, layer: DenseLayer) -> dict[str, Tensor]:
    """One Dense module's weights (linear.weight, linear.bias) under DenseProjection's names, checked."""
    expected = {"linear.weight": (layer.out_features, layer.in_features)}
    if layer.bias:
        expected["linear.bias"] = (layer.out_features,)
    if set(weights) != set(expected):
        raise DenseError(f"{path}: Dense weights {sorted(weights)}, expected {sorted(expected)}")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise DenseError(f"{path}: Dense weight {name} has shape {tuple(weights[name].shape)}, not {shape}")
    return {f"layers.{index}.{name.split('.')[-1]}": weights[name].to(torch.float32) for name in expected}


class DenseProjection(nn.Module):
    """The Dense modules in order: linear maps (the identity activation) of the pooled embedding."""

    def __init__(self, config: DenseConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Linear(layer.in_features, layer.out_features, bias=layer.bias) for layer in config.layers
        )

    def forward(self, pooled: Tensor) -> Tensor:
        """[batch, in_features of the first] -> [batch, out_features of the last]."""
        for layer in self.layers:
            pooled = layer(pooled)
        return pooled


class DenseEmbedder(nn.Module):
    """The encoder, its pooling, the Dense modules, then L2 normalisation when the folder ends with Normalize."""

    output_names = ("last_hidden_state", "embedding")

    def __init__(self, encoder: nn.Module, config: DenseConfig) -> None:
        super().__init__()
        self.config = encoder.config
        self.head_config = config
        self.encoder = encoder
        self.head = DenseProjection(config)

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Return (last_hidden_state [batch, seq, d_model], embedding [batch, d_model])."""
        hidden, mask = self.encoder.hidden_states(input_ids, attention_mask, token_type_ids)
        projected = self.head(pool(hidden, mask, self.config.pooling, normalize=False))
        if self.config.normalize:
            projected = F.normalize(projected, p=2.0, dim=1)
        return hidden, projected


def _read(source: HeadFolder, weights: HeadWeights) -> tuple[DenseConfig, dict[str, Tensor]]:
    """The Dense modules after Pooling, checked, with their weights under DenseProjection's names."""
    modules = source.declarations.pooled_dense
    layers: list[DenseLayer] = []
    state: dict[str, Tensor] = {}
    for index, (module_folder, settings) in enumerate(modules):
        width = layers[-1].out_features if layers else weights.d_model
        layer = dense_layer(module_folder / "config.json", settings, width)
        state |= layer_weights(module_folder, weights.read_file(module_folder), index, layer)
        layers.append(layer)
    config = DenseConfig(tuple(layers))
    check_width(modules[-1][0] / "config.json", config, weights.d_model)
    return config, state


HEAD = Head(
    name="dense",
    config_type=DenseConfig,
    task="embed",
    claims=lambda source: source.task == "embed" and bool(source.declarations.pooled_dense),
    read=_read,
    wrap=DenseEmbedder,
    outputs=lambda config, dense: embedder_outputs(config),
    parameters=lambda dense: {P_POOLED_PROJECTION: "dense"},
)
"""An embedder's Dense modules after pooling (EmbeddingGemma's projection)."""
