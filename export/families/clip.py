"""CLIP (transformers' CLIPModel) from its definition: an image tower and a text tower into one embedding space.

Image tower (a Vision Transformer): the image is cut into patch_size squares, each projected by a
convolution without bias to a token (export.layers.vision); a learned class token is put first, learned
position embeddings (one per patch, plus the class token's) are added, then a LayerNorm ("pre_layrnorm"),
S pre-norm layers, and the class token's final state is normalised (post_layernorm) and projected (no bias)
to projection_dim.

Text tower: token + learned position embeddings, S pre-norm layers under a causal mask (a token reads itself
and the earlier tokens the padding mask keeps), a final LayerNorm, and the state at the end-of-text token
is projected (no bias) to projection_dim. The end-of-text token is the first position holding
text_config.eos_token_id; for a config whose eos_token_id is 2 (written before transformers' PR #24773)
it is the position of the highest id, as transformers reads those checkpoints.

Both embeddings are the raw projections, as `get_image_features` and `get_text_features` return them
(sentence-transformers' CLIP folders encode the same); normalize L2-normalises them. The learned
logit_scale (the temperature of image-text scores) is set apart with the other scoring weights.
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
    ImageTower,
    TextTower,
    embedding_output,
    run_layers,
)

MODEL_TYPE = "clip"
TEXT_DEFAULTS: dict[str, object] = {
    "vocab_size": 49408,
    "hidden_size": 512,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 8,
    "max_position_embeddings": 77,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
    "pad_token_id": 1,
    "eos_token_id": 49407,
}
"""transformers' CLIPTextConfig defaults: a key text_config leaves out takes its value here."""
VISION_DEFAULTS: dict[str, object] = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 32,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
}
"""transformers' CLIPVisionConfig defaults."""
DEFAULT_PROJECTION_DIM = 512
LEGACY_EOS_TOKEN_ID = 2
"""An eos_token_id transformers takes to mean "the highest id ends the text" (configs before its PR #24773)."""
TEXT_KEYS = (*LAYER_KEYS, "hidden_act", "layer_norm_eps", "vocab_size", "max_position_embeddings")
TEXT_KEYS += ("pad_token_id", "eos_token_id", "projection_dim")  # projection_dim: CLIPTextModelWithProjection's
VISION_KEYS = (*LAYER_KEYS, "hidden_act", "layer_norm_eps", "image_size", "patch_size", "num_channels")
VISION_KEYS += ("projection_dim",)  # CLIPVisionModelWithProjection's; CLIPModel projects to the top-level one
VISION_KEYS += ("pad_token_id", "eos_token_id")  # transformers 4 wrote them (null) into every section; no image has ids
TOP_KEYS = ("text_config", "vision_config", "projection_dim", "logit_scale_init_value", "initializer_factor")
TOP_KEYS += ("text_config_dict", "vision_config_dict")  # transformers 4's legacy overrides, read only when null
WEIGHT_RENAMES = {
    "vision_model.embeddings.class_embedding": "vision.class_embedding",
    "vision_model.pre_layrnorm.": "vision.pre_norm.",
    "visual_projection.": "vision.projection.",
    "text_projection.": "text.projection.",
}
"""CLIPModel's own weight prefixes -> the towers' (besides two_tower.SHARED_RENAMES)."""
SCORING_WEIGHTS = ("logit_scale",)


@dataclass(frozen=True)
class ClipConfig(TwoTowerConfig):
    """Hyper-parameters of a CLIP model's two towers, validated on construction."""

    eos_token_id: int
    """The end-of-text token whose state is the text's embedding (LEGACY_EOS_TOKEN_ID: the highest id's)."""
    projection_dim: int
    """Width of both embeddings."""

    def __post_init__(self) -> None:
        super().__post_init__()
        value = self.eos_token_id
        if isinstance(value, list):
            raise ArchitectureError(f"unsupported text_config eos_token_id {value!r}: one end-of-text id only")
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < self.vocab_size:
            raise ArchitectureError(f"text_config eos_token_id {value!r} is not an id of the vocabulary")

    @property
    def d_model(self) -> int:
        """Width of the embeddings (both towers project to it)."""
        return self.projection_dim

    @property
    def pooling(self) -> str:
        """How the text tower picks its token: the first end-of-text token, or (legacy configs) the highest id."""
        return "highest_id" if self.eos_token_id == LEGACY_EOS_TOKEN_ID else "eos_token"

    @property
    def text_padding(self) -> str:
        """How texts are padded in a batch: to the batch's longest (the end-of-text token is read, padding masked)."""
        return "longest"


def _section(hf_config: dict, key: str) -> dict:
    """A tower's section; transformers 4's legacy override of it ({key}_dict) is read only when null."""
    legacy = f"{key}_dict"
    if hf_config.get(legacy) is not None:
        raise ArchitectureError(f"unsupported {legacy} (transformers 4's override of {key}): only {key} is read")
    return config_section(hf_config, key)


def read_config(hf_config: dict, pooling: str, normalize: bool) -> ClipConfig:
    """Translate a CLIPModel config.json; any key the towers do not implement is refused by name.

    pooling is not read: each tower pools as CLIP defines it (the class token, the end-of-text token).
    """
    del pooling
    check_keys(hf_config, "config.json", TOP_KEYS)
    text, vision = _section(hf_config, "text_config"), _section(hf_config, "vision_config")
    check_keys(text, "text_config", TEXT_KEYS)
    check_keys(vision, "vision_config", VISION_KEYS)
    return ClipConfig(
        **common_fields(text, vision, TEXT_DEFAULTS, VISION_DEFAULTS, normalize),
        eos_token_id=text.get("eos_token_id", TEXT_DEFAULTS["eos_token_id"]),
        projection_dim=positive_int(hf_config, "projection_dim", "config.json", DEFAULT_PROJECTION_DIM),
    )


def rename(weights: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """CLIPModel's weights under the towers' names; logit_scale apart; any other weight refused."""
    return rename_weights(weights, WEIGHT_RENAMES, SCORING_WEIGHTS)


class ClipVisionTower(ImageTower):
    """Patches and a class token, pre-LayerNorm, S layers, the class token's post-LayerNorm state, projected."""

    def __init__(self, config: ClipConfig) -> None:
        tower = config.vision
        super().__init__(config.geometry, tower, patch_bias=False, extra_positions=1, normalize=config.normalize)
        self.class_embedding = nn.Parameter(torch.zeros(tower.d_model))
        self.pre_norm = nn.LayerNorm(tower.d_model, eps=tower.layer_norm_eps)
        self.post_norm = nn.LayerNorm(tower.d_model, eps=tower.layer_norm_eps)
        self.projection = nn.Linear(tower.d_model, config.projection_dim, bias=False)

    def forward(self, pixel_values: Tensor) -> Tensor:
        """Pixel values [batch, channels, image_size, image_size] -> image embeddings [batch, projection_dim]."""
        patches = self.patches(pixel_values)
        class_token = self.class_embedding.expand(patches.shape[0], 1, -1)
        hidden = torch.cat([class_token, patches], dim=1) + self.position_embedding.weight
        hidden = run_layers(self.layers, self.pre_norm(hidden), None)
        return embedding_output(self.projection(self.post_norm(hidden[:, 0])), self.normalize)


class ClipTextTower(TextTower):
    """Token and position embeddings, S causal layers, final LayerNorm, the end-of-text state, projected (no bias)."""

    def __init__(self, config: ClipConfig) -> None:
        super().__init__(
            config.text,
            vocab_size=config.vocab_size,
            max_positions=config.max_positions,
            projection=(config.projection_dim, False),
            normalize=config.normalize,
        )
        self.eos_token_id = config.eos_token_id

    def end_of_text(self, input_ids: Tensor) -> Tensor:
        """Each row's end-of-text position [batch]: its first eos_token_id (legacy configs: its highest id)."""
        ids = input_ids.to(torch.int32)  # ArgMax in ONNX takes int32, not int64
        if self.eos_token_id == LEGACY_EOS_TOKEN_ID:
            return ids.argmax(dim=-1)
        return (ids == self.eos_token_id).to(torch.int32).argmax(dim=-1)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Token ids and their 0/1 mask [batch, seq] -> text embeddings [batch, projection_dim]."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        causal = positions[None, :] <= positions[:, None]  # key j ≤ query i
        states = self.final_states(input_ids, causal[None, None] & attention_mask[:, None, None, :].bool())
        rows = torch.arange(input_ids.shape[0], device=input_ids.device)
        return self.embedding(states[rows, self.end_of_text(input_ids)])


FAMILY = two_tower_family(
    "clip",
    MODEL_TYPE,
    ClipConfig,
    (ClipVisionTower, ClipTextTower),
    read_config=read_config,
    rename=rename,
)
"""CLIP (openai/clip-vit-*, LAION's OpenCLIP conversions): an image tower and a text tower."""
