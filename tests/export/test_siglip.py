"""SigLIP's towers (export.families.siglip) against transformers' SiglipModel, and their graphs against the towers.

One tiny random SiglipModel (text: hidden 32, 2 layers, 4 heads, 16 positions, its head projecting to the
image tower's width 48; image: hidden 48, 2 layers, 32-pixel images in 8-pixel patches, attention-pooled),
saved with save_pretrained and read back by the family's own reader. Texts are fed both ways: padded to
max_position_embeddings with padding attended and no mask, as SigLIP's processor feeds them, and padded to
the batch's longest with a mask, which transformers honours too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from export.checkpoints.architecture_error import ArchitectureError
from export.checkpoints.checkpoint import CheckpointError, load_checkpoint
from export.families import siglip
from export.families.registry import family_of, model_format
from export.layers.vision import TwoTowerModel
from tests.export.tiny_models import _randomise
from tests.export.two_towers import TOLERANCE, assert_graph_equals_tower, exported, images, texts

VOCAB_SIZE = 99
EOS = 98
PAD = 1
MAX_POSITIONS = 16
IMAGE_SIZE = 32


def _hf_config(**vision_overrides: object) -> transformers.SiglipConfig:
    text = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 32,
        "intermediate_size": 40,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": MAX_POSITIONS,
        "projection_size": 48,
        "bos_token_id": 97,
        "eos_token_id": EOS,
        "pad_token_id": PAD,
    }
    vision = {
        "hidden_size": 48,
        "intermediate_size": 56,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "image_size": IMAGE_SIZE,
        "patch_size": 8,
    }
    return transformers.SiglipConfig(text_config=text, vision_config=vision | vision_overrides)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny SiglipModel as save_pretrained writes it."""
    folder = tmp_path_factory.mktemp("siglip")
    torch.manual_seed(64)
    model = transformers.SiglipModel(_hf_config()).eval()
    _randomise(model, seed=64)
    model.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def reference(folder: Path) -> transformers.SiglipModel:
    """transformers' own SiglipModel on the saved weights."""
    return transformers.SiglipModel.from_pretrained(str(folder)).eval()


@pytest.fixture(scope="module")
def ours(folder: Path) -> TwoTowerModel:
    """Our towers as the family reads the folder: config.json, then the weights by name (strict)."""
    hf_config = json.loads((folder / "config.json").read_text())
    form = model_format(hf_config["model_type"])
    config = form.read_config(hf_config, "mean", False)
    weights, scoring = form.rename_weights(load_file(str(folder / "model.safetensors")))
    assert set(scoring) == {"logit_scale", "logit_bias"}
    model = family_of(config).build(config)
    model.load_state_dict(weights, strict=True)
    return model.eval()


def _images(count: int, seed: int = 0) -> torch.Tensor:
    return images(count, IMAGE_SIZE, seed)


def _texts(lengths: list[int], width: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return texts(lengths, width=width, eos=EOS, pad=PAD, seed=seed)


def test_image_features_equal_transformers(reference: transformers.SiglipModel, ours: TwoTowerModel) -> None:
    pixel_values = _images(3)
    with torch.inference_mode():
        expected = reference.get_image_features(pixel_values=pixel_values).pooler_output
        got = ours.vision(pixel_values)
    assert got.shape == (3, 48)
    assert float((got - expected).abs().max()) <= TOLERANCE


def test_text_features_equal_transformers_as_the_processor_feeds_them(
    reference: transformers.SiglipModel, ours: TwoTowerModel
) -> None:
    """Padded to max_position_embeddings, padding attended, no mask given to transformers."""
    input_ids, _ = _texts([4, 9, MAX_POSITIONS], MAX_POSITIONS)
    with torch.inference_mode():
        expected = reference.get_text_features(input_ids=input_ids).pooler_output
        got = ours.text(input_ids, torch.ones_like(input_ids))
    assert got.shape == (3, 48)
    assert float((got - expected).abs().max()) <= TOLERANCE


def test_text_features_equal_transformers_with_a_padding_mask(
    reference: transformers.SiglipModel, ours: TwoTowerModel
) -> None:
    """Padded to the longest row with a mask: the last position (padding for the shorter rows) is read, masked."""
    input_ids, attention_mask = _texts([5, 11, 7], 11, seed=2)
    with torch.inference_mode():
        expected = reference.get_text_features(input_ids=input_ids, attention_mask=attention_mask).pooler_output
        got = ours.text(input_ids, attention_mask)
    assert float((got - expected).abs().max()) <= TOLERANCE


def test_image_graph_equals_the_tower(ours: TwoTowerModel, tmp_path: Path) -> None:
    """Batches of 1 and 5 (traced with 2) through the graph and the tower."""
    session = exported(ours.vision, tmp_path / "image.onnx")
    assert session.get_outputs()[0].shape == ["batch", 48]
    assert_graph_equals_tower(session, ours.vision, [(_images(count, seed=count),) for count in (1, 5)])


def test_text_graph_equals_the_tower(ours: TwoTowerModel, tmp_path: Path) -> None:
    """Other batch sizes and lengths than traced, at max_position_embeddings and masked, through graph and tower."""
    session = exported(ours.text, tmp_path / "text.onnx")
    feeds = [_texts([3], MAX_POSITIONS), _texts([5, 9, MAX_POSITIONS], MAX_POSITIONS), _texts([2, 6, 4, 3], 6)]
    assert_graph_equals_tower(session, ours.text, feeds)


def test_the_exporter_loads_the_folder(folder: Path) -> None:
    """load_checkpoint reads a SiglipModel folder through the registry (normalised: no modules.json)."""
    checkpoint = load_checkpoint(folder)
    assert checkpoint.model_type == "siglip" and checkpoint.config.normalize
    assert (checkpoint.config.d_model, checkpoint.max_seq_length) == (48, MAX_POSITIONS)


def test_unimplemented_settings_are_refused_by_name() -> None:
    hf = _hf_config().to_dict()
    text, vision = hf["text_config"], hf["vision_config"]
    refusals = {
        "vision_config: unsupported hidden_act 'silu'": hf | {"vision_config": vision | {"hidden_act": "silu"}},
        "text_config: unsupported hidden_act 'gelu_fast'": hf | {"text_config": text | {"hidden_act": "gelu_fast"}},
        "unsupported vision_config vision_use_head False": hf | {"vision_config": vision | {"vision_use_head": False}},
        "text_config projection_size 32 is not the image embedding's width": hf
        | {"text_config": text | {"projection_size": 32}},
        "unsupported text_config key 'num_key_value_heads'": hf | {"text_config": text | {"num_key_value_heads": 2}},
        "unsupported config.json key 'logit_scale_init_value'": hf | {"logit_scale_init_value": 2.0},
        "vision_config patch_size must be a positive integer, got 0": hf
        | {"vision_config": vision | {"patch_size": 0}},
    }
    for message, config in refusals.items():
        with pytest.raises(ArchitectureError, match=message):
            siglip.read_config(config, "mean", False)
    defaults = siglip.read_config({"model_type": "siglip"}, "mean", True)  # google/siglip-base-patch16-224's shape
    assert (defaults.d_model, defaults.geometry.num_patches, defaults.max_positions) == (768, 196, 64)


def test_siglip2_naflex_is_refused_with_the_reason(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "siglip2"}))
    with pytest.raises(CheckpointError, match="unsupported architecture 'siglip2': SigLIP 2's NaFlex model"):
        load_checkpoint(tmp_path)


def test_weights_are_taken_by_name_and_strays_refused() -> None:
    tensor = torch.zeros(2)
    towers, scoring = siglip.rename(
        {
            "vision_model.head.attention.in_proj_weight": tensor,
            "vision_model.head.layernorm.bias": tensor,
            "text_model.head.weight": tensor,
            "logit_bias": tensor,
        }
    )
    assert set(towers) == {"vision.head.attention.in_proj_weight", "vision.head.norm.bias", "text.projection.weight"}
    assert set(scoring) == {"logit_bias"}
    with pytest.raises(ArchitectureError, match=r"unexpected weight 'vision_model\.embeddings\.class_embedding'"):
        siglip.rename({"vision_model.embeddings.class_embedding": tensor})
