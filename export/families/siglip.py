"""SigLIP and SigLIP 2's fixed-resolution models (transformers' SiglipModel) from their definition: two towers.

Image tower: the image is cut into patch_size squares, each projected by a convolution (with bias) to a
token (export.layers.vision); learned position embeddings, one per patch, are added (no class token),
then S pre-norm layers and a LayerNorm (post_layernorm). The image's embedding is made by multi-head
attention pooling ("MAP"): a learned probe token attends over every patch state (torch's
MultiheadAttention, its Q, K, V projections in one in_proj matrix), then y = a + MLP(LN(a)) on the
attended vector a. No projection follows: the embedding is hidden_size wide.

Text tower: token + learned position embeddings, S pre-norm layers attending in both directions over the
tokens the mask keeps, a final LayerNorm, and the state at the sequence's last position goes through a
linear head (with bias) to projection_size. The last position is the sequence's, not the text's: SigLIP
was trained on texts padded to max_position_embeddings (64) with padding attended, so the embedding of a
text is the one it has fed that way, as the reference processor feeds it (padding="max_length"); the
tower answers as transformers does for whatever ids and mask it is given.

SigLIP 2's fixed-resolution checkpoints (google/siglip2-*-patch16-224 and the like) are SiglipModel folders
and read here; its NaFlex models (model_type siglip2) are not. Both embeddings are raw, as
`get_image_features` and `get_text_features` return them; normalize L2-normalises them. The learned
logit_scale and logit_bias (the sigmoid's temperature and offset) are set apart as scoring weights.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from export.checkpoints.architecture_error import ArchitectureError
from export.families.family import Family, Format
from export.layers.vision import (
    LAYER_KEYS,
    MLP,
    ImageGeometry,
    ImageTower,
    TextTower,
    TowerConfig,
    attention_bias,
    check_keys,
    embedding_output,
    layer_stack,
    patch_tokens,
    positive_int,
    read_geometry,
    read_tower,
    rename_weights,
    run_layers,
)

MODEL_TYPE = "siglip"
TEXT_DEFAULTS: dict[str, object] = {
    "vocab_size": 32000,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "max_position_embeddings": 64,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
    "pad_token_id": 1,
}
"""transformers' SiglipTextConfig defaults: a key text_config leaves out takes its value here."""
VISION_DEFAULTS: dict[str, object] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 16,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
}
"""transformers' SiglipVisionConfig defaults."""
TEXT_KEYS = (*LAYER_KEYS, "hidden_act", "layer_norm_eps", "vocab_size", "max_position_embeddings")
TEXT_KEYS += ("pad_token_id", "eos_token_id", "projection_size")
VISION_KEYS = (*LAYER_KEYS, "hidden_act", "layer_norm_eps", "image_size", "patch_size", "num_channels")
VISION_KEYS += ("vision_use_head", "pad_token_id", "eos_token_id")  # token ids: written by transformers 4, unread
TOP_KEYS = ("text_config", "vision_config", "initializer_factor")
WEIGHT_RENAMES = {
    "vision_model.embeddings.patch_embedding.": "vision.patch_embedding.",
    "vision_model.embeddings.position_embedding.": "vision.position_embedding.",
    "vision_model.encoder.layers.": "vision.layers.",
    "vision_model.post_layernorm.": "vision.post_norm.",
    "vision_model.head.probe": "vision.head.probe",
    "vision_model.head.attention.": "vision.head.attention.",
    "vision_model.head.layernorm.": "vision.head.norm.",
    "vision_model.head.mlp.": "vision.head.mlp.",
    "text_model.embeddings.token_embedding.": "text.token_embedding.",
    "text_model.embeddings.position_embedding.": "text.position_embedding.",
    "text_model.encoder.layers.": "text.layers.",
    "text_model.final_layer_norm.": "text.final_norm.",
    "text_model.head.": "text.projection.",
}
"""SiglipModel's weight prefixes -> the towers' (layers keep transformers' names)."""
SCORING_WEIGHTS = ("logit_scale", "logit_bias")
POSITION_IDS = ("vision_model.embeddings.position_ids", "text_model.embeddings.position_ids")


@dataclass(frozen=True)
class SiglipConfig:
    """Hyper-parameters of a SigLIP model's two towers, validated on construction."""

    vision: TowerConfig
    text: TowerConfig
    geometry: ImageGeometry
    vocab_size: int
    max_positions: int
    """The text length SigLIP was trained on (texts padded to it) and the most its positions cover."""
    pad_token_id: int
    projection_size: int
    """Width of the text head's output, which is the image embedding's width too."""
    normalize: bool = False
    """L2-normalise both embeddings."""

    def __post_init__(self) -> None:
        if self.projection_size != self.vision.d_model:
            raise ArchitectureError(
                f"text_config projection_size {self.projection_size} is not the image embedding's width"
                f" (vision_config hidden_size {self.vision.d_model}): the two embeddings would not share a space"
            )
        if isinstance(self.pad_token_id, bool) or not isinstance(self.pad_token_id, int):
            raise ArchitectureError(f"text_config pad_token_id must be an integer, got {self.pad_token_id!r}")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ArchitectureError(f"text_config pad_token_id {self.pad_token_id} is not an id of the vocabulary")

    @property
    def d_model(self) -> int:
        """Width of the embeddings."""
        return self.projection_size

    @property
    def num_heads(self) -> int:
        """The text tower's attention heads."""
        return self.text.num_heads

    @property
    def num_layers(self) -> int:
        """The text tower's layers."""
        return self.text.num_layers

    @property
    def head_dim(self) -> int:
        """The text tower's d_k."""
        return self.text.head_dim

    @property
    def pooling(self) -> str:
        """How the text tower picks its token: the sequence's last position."""
        return "last_position"

    @property
    def uses_segments(self) -> bool:
        """SigLIP takes no token_type_ids."""
        return False

    @property
    def max_sequence_positions(self) -> int:
        """Longest text the model was made for."""
        return self.max_positions

    def to_dict(self) -> dict[str, object]:
        """Plain-data form, for parity.json."""
        return dataclasses.asdict(self)


def _section(hf_config: dict, key: str) -> dict:
    section = hf_config.get(key) or {}
    if not isinstance(section, dict):
        raise ArchitectureError(f"config.json {key} must be an object, got {type(section).__name__}")
    return section


def read_config(hf_config: dict, pooling: str, normalize: bool) -> SiglipConfig:
    """Translate a SiglipModel config.json; any key the towers do not implement is refused by name.

    pooling is not read: each tower pools as SigLIP defines it (attention pooling, the last position).
    """
    del pooling
    check_keys(hf_config, "config.json", TOP_KEYS)
    text, vision = _section(hf_config, "text_config"), _section(hf_config, "vision_config")
    check_keys(text, "text_config", TEXT_KEYS)
    check_keys(vision, "vision_config", VISION_KEYS)
    if vision.get("vision_use_head", True) is not True:
        raise ArchitectureError(
            f"unsupported vision_config vision_use_head {vision['vision_use_head']!r}: without its attention-pooling"
            " head SigLIP's image tower makes no image embedding"
        )
    text_tower = read_tower(text, "text_config", TEXT_DEFAULTS)
    projection_size = text.get("projection_size")
    pad_token_id = text.get("pad_token_id", TEXT_DEFAULTS["pad_token_id"])
    return SiglipConfig(
        vision=read_tower(vision, "vision_config", VISION_DEFAULTS),
        text=text_tower,
        geometry=read_geometry(vision, "vision_config", VISION_DEFAULTS),
        vocab_size=positive_int(text, "vocab_size", "text_config", TEXT_DEFAULTS["vocab_size"]),
        max_positions=positive_int(
            text, "max_position_embeddings", "text_config", TEXT_DEFAULTS["max_position_embeddings"]
        ),
        pad_token_id=0 if pad_token_id is None else pad_token_id,
        projection_size=text_tower.d_model
        if projection_size is None
        else positive_int(text, "projection_size", "text_config"),
        normalize=normalize,
    )


def rename(weights: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """SiglipModel's weights under the towers' names; logit_scale and logit_bias apart; any other weight refused."""
    return rename_weights(weights, WEIGHT_RENAMES, SCORING_WEIGHTS, POSITION_IDS)


class ProbeAttention(nn.Module):
    """Multi-head attention of probe tokens over states, as torch's MultiheadAttention (names kept)."""

    def __init__(self, tower: TowerConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = tower.num_heads, tower.head_dim
        self.in_proj_weight = nn.Parameter(torch.zeros(3 * tower.d_model, tower.d_model))
        """W_Q, W_K, W_V stacked."""
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * tower.d_model))
        self.out_proj = nn.Linear(tower.d_model, tower.d_model)

    def _heads(self, states: Tensor, part: int) -> Tensor:
        """States [batch, n, d_model] projected by part (0: Q, 1: K, 2: V) of in_proj -> [batch, heads, n, d_k]."""
        width = self.out_proj.in_features
        weight = self.in_proj_weight[part * width : (part + 1) * width]
        bias = self.in_proj_bias[part * width : (part + 1) * width]
        projected = torch.nn.functional.linear(states, weight, bias)
        return projected.view(states.shape[0], states.shape[1], self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, probe: Tensor, states: Tensor) -> Tensor:
        """Probe [batch, p, d_model] attending over states [batch, n, d_model] -> [batch, p, d_model]."""
        query = self._heads(probe, 0) * self.head_dim**-0.5  # torch scales Q before QKᵀ
        key, value = self._heads(states, 1), self._heads(states, 2)
        weights = torch.softmax(torch.matmul(query, key.transpose(-1, -2)), dim=-1)
        context = torch.matmul(weights, value).transpose(1, 2)
        return self.out_proj(context.reshape(probe.shape[0], probe.shape[1], -1))


class AttentionPooling(nn.Module):
    """MAP: a learned probe attends over the patch states; y = a + MLP(LN(a)), the probe's row."""

    def __init__(self, tower: TowerConfig) -> None:
        super().__init__()
        self.probe = nn.Parameter(torch.zeros(1, 1, tower.d_model))
        self.attention = ProbeAttention(tower)
        self.norm = nn.LayerNorm(tower.d_model, eps=tower.layer_norm_eps)
        self.mlp = MLP(tower)

    def forward(self, hidden: Tensor) -> Tensor:
        """Patch states [batch, patches, d_model] -> one vector a row [batch, d_model]."""
        attended = self.attention(self.probe.expand(hidden.shape[0], -1, -1), hidden)
        return (attended + self.mlp(self.norm(attended)))[:, 0]


class SiglipVisionTower(ImageTower):
    """Patches plus positions, S layers, post-LayerNorm, attention pooling."""

    def __init__(self, config: SiglipConfig) -> None:
        super().__init__(config.geometry)
        tower, geometry = config.vision, config.geometry
        self.patch_embedding = nn.Conv2d(
            geometry.num_channels, tower.d_model, geometry.patch_size, stride=geometry.patch_size
        )
        self.position_embedding = nn.Embedding(geometry.num_patches, tower.d_model)
        self.layers = layer_stack(tower)
        self.post_norm = nn.LayerNorm(tower.d_model, eps=tower.layer_norm_eps)
        self.head = AttentionPooling(tower)
        self.normalize = config.normalize

    def forward(self, pixel_values: Tensor) -> Tensor:
        """Pixel values [batch, channels, image_size, image_size] -> image embeddings [batch, hidden_size]."""
        patches = patch_tokens(self.patch_embedding, pixel_values.to(self.patch_embedding.weight.dtype))
        hidden = run_layers(self.layers, patches + self.position_embedding.weight, None)
        return embedding_output(self.head(self.post_norm(hidden)), self.normalize)


class SiglipTextTower(TextTower):
    """Token and position embeddings, S bidirectional layers, final LayerNorm, the last position through the head."""

    def __init__(self, config: SiglipConfig) -> None:
        super().__init__()
        tower = config.text
        self.token_embedding = nn.Embedding(config.vocab_size, tower.d_model)
        self.position_embedding = nn.Embedding(config.max_positions, tower.d_model)
        self.layers = layer_stack(tower)
        self.final_norm = nn.LayerNorm(tower.d_model, eps=tower.layer_norm_eps)
        self.projection = nn.Linear(tower.d_model, config.projection_size)
        self.normalize = config.normalize

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Token ids and their 0/1 mask [batch, seq] -> text embeddings [batch, projection_size]."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        hidden = self.token_embedding(input_ids) + self.position_embedding(positions)
        bias = attention_bias(attention_mask[:, None, None, :].bool(), hidden.dtype)
        hidden = self.final_norm(run_layers(self.layers, hidden, bias))
        return embedding_output(self.projection(hidden[:, -1]), self.normalize)


class SiglipModel(nn.Module):
    """Both towers of a SigLIP model, each exported as its own graph (export.graph.towers)."""

    def __init__(self, config: SiglipConfig) -> None:
        super().__init__()
        self.config = config
        self.vision = SiglipVisionTower(config)
        self.text = SiglipTextTower(config)


FAMILY = Family(
    name="siglip",
    config_type=SiglipConfig,
    build=SiglipModel,
    formats=(Format(MODEL_TYPE, read_config, rename),),
    towers=("image", "text"),
)
"""SigLIP (google/siglip-*) and SigLIP 2's fixed-resolution checkpoints: an image tower and a text tower."""
