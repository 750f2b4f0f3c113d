"""What the two-tower families (CLIP, SigLIP: export.families.clip, .siglip) read alike from their folders.

Their config.json holds one section a tower (text_config, vision_config) besides a few keys of its own. Each
section is read key by key: the keys a tower reads, the ones only training uses, and the bookkeeping every
transformers config carries are known; any other key is refused by name, never ignored. A key a section
leaves out takes transformers' default for that family. Their weights are renamed by prefix onto the towers
(export.layers.vision), the scoring weights (logit scale, bias) set apart, anything else refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from export.checkpoints.architecture_error import ArchitectureError
from export.families.family import Family, Format
from export.layers.vision import ImageGeometry, ImageTower, TextTower, TowerConfig, TwoTowerModel

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


def config_section(hf_config: dict, key: str) -> dict:
    """config.json's section of one tower (text_config, vision_config); {} where absent (all defaults)."""
    section = hf_config.get(key) or {}
    if not isinstance(section, dict):
        raise ArchitectureError(f"config.json {key} must be an object, got {type(section).__name__}")
    return section


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


def read_geometry(section: dict, where: str, defaults: dict[str, object]) -> ImageGeometry:
    """image_size, patch_size (integers: one side of a square) and num_channels of a vision config section."""
    geometry = ImageGeometry(
        *(positive_int(section, key, where, defaults.get(key)) for key in ("image_size", "patch_size", "num_channels"))
    )
    if geometry.patch_size > geometry.image_size:
        raise ArchitectureError(f"{where} patch_size {geometry.patch_size} exceeds image_size {geometry.image_size}")
    return geometry


def common_fields(
    text: dict, vision: dict, text_defaults: dict[str, object], vision_defaults: dict[str, object], normalize: bool
) -> dict[str, object]:
    """TwoTowerConfig's fields from the two sections (each family's defaults where a key is left out).

    A null pad_token_id reads as 0: the towers never read it.
    """
    pad_token_id = text.get("pad_token_id", text_defaults["pad_token_id"])
    return {
        "vision": read_tower(vision, "vision_config", vision_defaults),
        "text": read_tower(text, "text_config", text_defaults),
        "geometry": read_geometry(vision, "vision_config", vision_defaults),
        "vocab_size": positive_int(text, "vocab_size", "text_config", text_defaults["vocab_size"]),
        "max_positions": positive_int(
            text, "max_position_embeddings", "text_config", text_defaults["max_position_embeddings"]
        ),
        "pad_token_id": 0 if pad_token_id is None else pad_token_id,
        "normalize": normalize,
    }


@dataclass(frozen=True)
class TwoTowerConfig:
    """What a two-tower family's configuration holds in common, and answers as the exporter asks any (EncoderSettings).

    Each family's frozen dataclass extends it with its own fields (and their checks in __post_init__).
    """

    vision: TowerConfig
    text: TowerConfig
    geometry: ImageGeometry
    """The image the vision tower takes."""
    vocab_size: int
    max_positions: int
    """Longest text the text tower's position embedding covers."""
    pad_token_id: int
    normalize: bool
    """L2-normalise both embeddings."""

    def __post_init__(self) -> None:
        value = self.pad_token_id
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < self.vocab_size:
            raise ArchitectureError(f"text_config pad_token_id {value!r} is not an id of the vocabulary")

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
    def uses_segments(self) -> bool:
        """The towers take no token_type_ids."""
        return False

    @property
    def max_sequence_positions(self) -> int:
        """Longest text the model was made for."""
        return self.max_positions

    @property
    def text_padding(self) -> str:
        """How texts are padded in a batch: "longest" (to the batch's longest) or "max_length" (to max_positions)."""
        raise NotImplementedError

    def to_dict(self) -> dict[str, object]:
        """Plain-data form, for parity.json."""
        return dataclasses.asdict(self)


SHARED_RENAMES = {
    "vision_model.embeddings.patch_embedding.": "vision.patch_embedding.",
    "vision_model.embeddings.position_embedding.": "vision.position_embedding.",
    "vision_model.encoder.layers.": "vision.layers.",
    "vision_model.post_layernorm.": "vision.post_norm.",
    "text_model.embeddings.token_embedding.": "text.token_embedding.",
    "text_model.embeddings.position_embedding.": "text.position_embedding.",
    "text_model.encoder.layers.": "text.layers.",
    "text_model.final_layer_norm.": "text.final_norm.",
}
"""The weight prefixes CLIPModel and SiglipModel share -> the towers' (layers keep transformers' names)."""
POSITION_IDS = ("vision_model.embeddings.position_ids", "text_model.embeddings.position_ids")
"""Buffers of positions 0, 1, 2, ... that older checkpoints saved."""


def rename_weights(
    weights: dict[str, Tensor], renames: dict[str, str], heads: tuple[str, ...]
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """A two-tower checkpoint's weights under the towers' names, and its scoring weights (heads) apart.

    renames: the family's checkpoint prefixes -> ours, besides SHARED_RENAMES. POSITION_IDS buffers are
    checked and dropped. Any other weight is refused by name.
    """
    renames = SHARED_RENAMES | renames
    towers: dict[str, Tensor] = {}
    head_weights: dict[str, Tensor] = {}
    for name, tensor in weights.items():
        if name in heads:
            head_weights[name] = tensor
        elif name in POSITION_IDS:
            if not torch.equal(tensor.reshape(-1).to(torch.int64), torch.arange(tensor.numel())):
                raise ArchitectureError(f"{name} is not the positions 0, 1, 2, ... in order")
        else:
            prefix = next((prefix for prefix in renames if name.startswith(prefix)), None)
            if prefix is None:
                raise ArchitectureError(f"unexpected weight {name!r}")
            towers[renames[prefix] + name[len(prefix) :]] = tensor
    return towers, head_weights


def two_tower_family(
    name: str,
    model_type: str,
    config_type: type[TwoTowerConfig],
    towers: tuple[Callable[[TwoTowerConfig], ImageTower], Callable[[TwoTowerConfig], TextTower]],
    *,
    read_config: Callable[[dict, str, bool], TwoTowerConfig],
    rename: Callable[[dict[str, Tensor]], tuple[dict[str, Tensor], dict[str, Tensor]]],
) -> Family:
    """A two-tower family's declaration: its one model type, and both towers (image, text) built from its config."""

    def build(config: TwoTowerConfig) -> TwoTowerModel:
        vision, text = towers
        return TwoTowerModel(config, vision(config), text(config))

    return Family(
        name=name,
        config_type=config_type,
        build=build,
        formats=(Format(model_type, read_config, rename),),
        towers=("image", "text"),
    )
