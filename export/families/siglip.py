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
was trained on texts padded to max_position_embeddings (64), and its processor pads them so
(padding="max_length"), so a text's embedding is read at a padding position unless it fills all 64. The
tower answers as transformers does for whatever ids and 0/1 mask it is given (all ones: padding attended,
as the original model and transformers without a mask; the padding mask: as transformers with one).

SigLIP 2's fixed-resolution checkpoints (google/siglip2-*-patch16-224 and the like) are SiglipModel folders
and read here; its NaFlex models (model_type siglip2) are not. Both embeddings are raw, as
`get_image_features` and `get_text_features` return them; normalize L2-normalises them. The learned
logit_scale and logit_bias (the sigmoid's temperature and offset) are set apart as scoring weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from export.checkpoints.architecture_error import ArchitectureError
from export.families.two_tower import (
    LAYER_KEYS,
    TwoTowerConfig,
    check_keys,
    common_fields,
    config_section,
    positive_int,
    rename_weights,
    two_tower_family,
)
from export.layers.vision import (
    MLP,
    ImageTower,
    TextTower,
    TowerConfig,
    embedding_output,
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
    "vision_model.head.probe": "vision.head.probe",
    "vision_model.head.attention.": "vision.head.attention.",
    "vision_model.head.layernorm.": "vision.head.norm.",
    "vision_model.head.mlp.": "vision.head.mlp.",
    "text_model.head.": "text.projection.",
}
"""SiglipModel's own weight prefixes -> the towers' (besides two_tower.SHARED_RENAMES)."""
SCORING_WEIGHTS = ("logit_scale", "logit_bias")


@dataclass(frozen=True)
class SiglipConfig(TwoTowerConfig):
    """Hyper-parameters of a SigLIP model's two towers, validated on construction.

    max_positions is also the text length SigLIP was trained on (texts padded to it).
    """

    projection_size: int
    """Width of the text head's output, which is the image embedding's width too."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.projection_size != self.vision.d_model:
            raise ArchitectureError(
                f"text_config projection_size {self.projection_size} is not the image embedding's width"
                f" (vision_config hidden_size {self.vision.d_model}): the two embeddings would not share a space"
            )

    @property
    def d_model(self) -> int:
        """Width of the embeddings."""
        return self.projection_size

    @property
    def pooling(self) -> str:
        """How the text tower picks its token: the sequence's last position."""
        return "last_position"

    @property
    def text_padding(self) -> str:
        """How texts are padded: to max_positions, as SigLIP was trained (its last position is read)."""
        return "max_length"


def read_config(hf_config: dict, pooling: str, normalize: bool) -> SiglipConfig:
    """Translate a SiglipModel config.json; any key the towers do not implement is refused by name.

    pooling is not read: each tower pools as SigLIP defines it (attention pooling, the last position).
    """
    del pooling
    check_keys(hf_config, "config.json", TOP_KEYS)
    text, vision = config_section(hf_config, "text_config"), config_section(hf_config, "vision_config")
    check_keys(text, "text_config", TEXT_KEYS)
    check_keys(vision, "vision_config", VISION_KEYS)
    if vision.get("vision_use_head", True) is not True:
        raise ArchitectureError(
            f"unsupported vision_config vision_use_head {vision['vision_use_head']!r}: without its attention-pooling"
            " head SigLIP's image tower makes no image embedding"
        )
    fields = common_fields(text, vision, TEXT_DEFAULTS, VISION_DEFAULTS, normalize)
    projection_size = text.get("projection_size")
    if projection_size is not None:
        projection_size = positive_int(text, "projection_size", "text_config")
    return SiglipConfig(**fields, projection_size=projection_size or fields["text"].d_model)


def rename(weights: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """SiglipModel's weights under the towers' names; logit_scale and logit_bias apart; any other weight refused."""
    return rename_weights(weights, WEIGHT_RENAMES, SCORING_WEIGHTS)


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
        tower = config.vision
        super().__init__(config.geometry, tower, patch_bias=True, extra_positions=0, normalize=config.normalize)
        self.post_norm = nn.LayerNorm(tower.d_model, eps=tower.layer_norm_eps)
        self.head = AttentionPooling(tower)

    def forward(self, pixel_values: Tensor) -> Tensor:
        """Pixel values [batch, channels, image_size, image_size] -> image embeddings [batch, hidden_size]."""
        hidden = run_layers(self.layers, self.patches(pixel_values) + self.position_embedding.weight, None)
        return embedding_output(self.head(self.post_norm(hidden)), self.normalize)


class SiglipTextTower(TextTower):
    """Token and position embeddings, S bidirectional layers, final LayerNorm, the last position through the head."""

    def __init__(self, config: SiglipConfig) -> None:
        super().__init__(
            config.text,
            vocab_size=config.vocab_size,
            max_positions=config.max_positions,
            projection=(config.projection_size, True),
            normalize=config.normalize,
        )

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Token ids and their 0/1 mask [batch, seq] -> text embeddings [batch, projection_size]."""
        states = self.final_states(input_ids, attention_mask[:, None, None, :].bool())
        return self.embedding(states[:, -1])


FAMILY = two_tower_family(
    "siglip",
    MODEL_TYPE,
    SiglipConfig,
    (SiglipVisionTower, SiglipTextTower),
    read_config=read_config,
    rename=rename,
)
"""SigLIP (google/siglip-*) and SigLIP 2's fixed-resolution checkpoints: an image tower and a text tower."""
