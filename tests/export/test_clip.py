"""CLIP's towers (export.families.clip) against transformers' CLIPModel, and their graphs against the towers.

One tiny random CLIPModel (text: hidden 32, 2 layers, 4 heads, 16 positions; image: hidden 48, 2 layers,
30-pixel images in 8-pixel patches, so that the last 6 pixels of each side are past the last whole patch;
both projected to 24), saved with save_pretrained and read back by the family's own reader. Its padding id
is its end-of-text id, as in OpenAI's CLIP, so that the text embedding must come from the first one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from export.checkpoints.architecture_error import ArchitectureError
from export.checkpoints.checkpoint import load_checkpoint
from export.families import clip
from export.families.registry import family_of, model_format
from export.layers.vision import TwoTowerModel
from tests.export.tiny_models import _randomise
from tests.export.two_towers import TOLERANCE, assert_graph_equals_tower, exported, images, texts

VOCAB_SIZE = 99
EOS = 98
"""The end-of-text id, which pads too (OpenAI's CLIP pads with it)."""
MAX_POSITIONS = 16
IMAGE_SIZE = 30


def _hf_config(**text_overrides: object) -> transformers.CLIPConfig:
    text = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 32,
        "intermediate_size": 40,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": MAX_POSITIONS,
        "bos_token_id": 97,
        "eos_token_id": EOS,
        "pad_token_id": EOS,
    }
    vision = {
        "hidden_size": 48,
        "intermediate_size": 56,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "image_size": IMAGE_SIZE,
        "patch_size": 8,
    }
    return transformers.CLIPConfig(text_config=text | text_overrides, vision_config=vision, projection_dim=24)


def _hf_model(config: transformers.CLIPConfig, seed: int) -> transformers.CLIPModel:
    torch.manual_seed(seed)
    model = transformers.CLIPModel(config).eval()
    _randomise(model, seed)
    return model


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny CLIPModel as save_pretrained writes it."""
    folder = tmp_path_factory.mktemp("clip")
    _hf_model(_hf_config(), seed=48).save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def reference(folder: Path) -> transformers.CLIPModel:
    """transformers' own CLIPModel on the saved weights."""
    return transformers.CLIPModel.from_pretrained(str(folder)).eval()


def _read(folder: Path, normalize: bool = False) -> TwoTowerModel:
    """The towers as the family reads a folder: config.json, then the weights by name (strict)."""
    form = model_format(json.loads((folder / "config.json").read_text())["model_type"])
    config = form.read_config(json.loads((folder / "config.json").read_text()), "mean", normalize)
    weights, scoring = form.rename_weights(load_file(str(folder / "model.safetensors")))
    assert set(scoring) == {"logit_scale"}
    model = family_of(config).build(config)
    model.load_state_dict(weights, strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def ours(folder: Path) -> TwoTowerModel:
    """Our towers on the saved weights."""
    return _read(folder)


def _images(count: int, seed: int = 0) -> torch.Tensor:
    return images(count, IMAGE_SIZE, seed)


def _texts(lengths: list[int], pad: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return texts(lengths, width=max(lengths), eos=EOS, pad=pad, seed=seed)


def test_image_features_equal_transformers(reference: transformers.CLIPModel, ours: TwoTowerModel) -> None:
    pixel_values = _images(3)
    with torch.inference_mode():
        expected = reference.get_image_features(pixel_values=pixel_values).pooler_output
        got = ours.vision(pixel_values)
    assert got.shape == (3, 24)
    assert float((got - expected).abs().max()) <= TOLERANCE


def test_text_features_equal_transformers(reference: transformers.CLIPModel, ours: TwoTowerModel) -> None:
    """Right-padded rows of three lengths (one using every position), padding with the end-of-text id."""
    input_ids, attention_mask = _texts([5, 9, MAX_POSITIONS], pad=EOS)
    with torch.inference_mode():
        expected = reference.get_text_features(input_ids=input_ids, attention_mask=attention_mask).pooler_output
        got = ours.text(input_ids, attention_mask)
        alone = ours.text(input_ids[:1, :5], attention_mask[:1, :5])
    assert float((got - expected).abs().max()) <= TOLERANCE
    assert float((alone - got[:1]).abs().max()) <= TOLERANCE  # padding changes nothing


def test_a_legacy_end_of_text_id_reads_the_highest_id() -> None:
    """A config whose eos_token_id is 2 (before transformers' PR #24773): the text ends at its highest id."""
    hf = _hf_model(_hf_config(eos_token_id=2, pad_token_id=0), seed=7)
    config = clip.read_config(hf.config.to_dict(), "mean", False)
    assert config.pooling == "highest_id"
    ours = clip.FAMILY.build(config).eval()
    ours.load_state_dict(clip.rename(hf.state_dict())[0], strict=True)
    input_ids, attention_mask = _texts([4, 11, 7], pad=0, seed=3)  # EOS (98) is every row's highest id
    with torch.inference_mode():
        expected = hf.get_text_features(input_ids=input_ids, attention_mask=attention_mask).pooler_output
        got = ours.text(input_ids, attention_mask)
    assert float((got - expected).abs().max()) <= TOLERANCE


def test_the_exporter_loads_the_folder_normalised(folder: Path, reference: transformers.CLIPModel) -> None:
    """load_checkpoint reads a CLIPModel folder through the registry; without modules.json it normalises."""
    checkpoint = load_checkpoint(folder)
    assert checkpoint.model_type == "clip" and checkpoint.config.normalize
    assert (checkpoint.config.d_model, checkpoint.max_seq_length) == (24, MAX_POSITIONS)
    model = checkpoint.build_model()
    pixel_values = _images(2, seed=5)
    with torch.inference_mode():
        expected = reference.get_image_features(pixel_values=pixel_values).pooler_output
        got = model.vision(pixel_values)
    assert float((got - torch.nn.functional.normalize(expected, dim=-1)).abs().max()) <= TOLERANCE


def test_image_graph_equals_the_tower(ours: TwoTowerModel, tmp_path: Path) -> None:
    """Batches of 1 and 5 (traced with 2) through the graph and the tower."""
    session = exported(ours.vision, tmp_path / "image.onnx")
    assert [i.name for i in session.get_inputs()] == ["pixel_values"]
    assert session.get_outputs()[0].shape == ["batch", 24]
    assert_graph_equals_tower(session, ours.vision, [(_images(count, seed=count),) for count in (1, 5)])


def test_text_graph_equals_the_tower(ours: TwoTowerModel, tmp_path: Path) -> None:
    """Batches of other sizes and lengths than traced, padded, through the graph and the tower."""
    session = exported(ours.text, tmp_path / "text.onnx")
    assert [i.name for i in session.get_inputs()] == ["input_ids", "attention_mask"]
    lengths = ([3], [5, 9, MAX_POSITIONS], [2, 4, 6, 12, 3])
    assert_graph_equals_tower(session, ours.text, [_texts(row, pad=EOS, seed=len(row)) for row in lengths])


def test_unimplemented_settings_are_refused_by_name() -> None:
    hf = _hf_config().to_dict()
    text, vision = hf["text_config"], hf["vision_config"]
    refusals = {
        "text_config: unsupported hidden_act 'swish'": hf | {"text_config": text | {"hidden_act": "swish"}},
        "vision_config: unsupported hidden_act 'relu'": hf | {"vision_config": vision | {"hidden_act": "relu"}},
        "unsupported vision_config key 'use_rope' \\(=True\\)": hf | {"vision_config": vision | {"use_rope": True}},
        "unsupported config.json key 'text_embed_dim'": hf | {"text_embed_dim": 32},
        "vision_config image_size must be a positive integer, got \\[30, 40\\]": hf
        | {"vision_config": vision | {"image_size": [30, 40]}},
        "unsupported text_config_dict": hf | {"text_config_dict": {"hidden_size": 64}},
        "unsupported text_config eos_token_id \\[98, 2\\]": hf | {"text_config": text | {"eos_token_id": [EOS, 2]}},
        "unsupported text_config is_decoder true": hf | {"text_config": text | {"is_decoder": True}},
        "vision_config: hidden_size 48 is not divisible by num_attention_heads 5": hf
        | {"vision_config": vision | {"num_attention_heads": 5}},
    }
    for message, config in refusals.items():
        with pytest.raises(ArchitectureError, match=message):
            clip.read_config(config, "mean", False)
    read = clip.read_config(hf | {"text_config_dict": None}, "mean", False)
    assert (read.projection_dim, read.geometry.num_patches, read.eos_token_id) == (24, 9, EOS)


TRANSFORMERS_4_SECTION = {
    "_name_or_path": "", "add_cross_attention": False, "architectures": None, "bad_words_ids": None,
    "chunk_size_feed_forward": 0, "cross_attention_hidden_size": None, "decoder_start_token_id": None,
    "diversity_penalty": 0.0, "do_sample": False, "dropout": 0.0, "early_stopping": False,
    "encoder_no_repeat_ngram_size": 0, "finetuning_task": None, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "id2label": {"0": "LABEL_0", "1": "LABEL_1"}, "is_decoder": False,
    "is_encoder_decoder": False, "label2id": {"LABEL_0": 0, "LABEL_1": 1}, "length_penalty": 1.0, "max_length": 20,
    "min_length": 0, "no_repeat_ngram_size": 0, "num_beam_groups": 1, "num_beams": 1, "num_return_sequences": 1,
    "output_attentions": False, "output_hidden_states": False, "output_scores": False, "prefix": None,
    "problem_type": None, "pruned_heads": {}, "remove_invalid_values": False, "repetition_penalty": 1.0,
    "return_dict": True, "return_dict_in_generate": False, "sep_token_id": None, "task_specific_params": None,
    "temperature": 1.0, "tie_encoder_decoder": False, "tie_word_embeddings": True, "tokenizer_class": None,
    "top_k": 50, "top_p": 1.0, "torch_dtype": None, "torchscript": False, "transformers_version": "4.16.0.dev0",
    "use_bfloat16": False,
}  # fmt: skip
"""What transformers 4.16 wrote into each section of a config (OpenAI's CLIP folders carry it), besides the model's."""


def test_a_transformers_4_config_is_read_as_transformers_reads_it() -> None:
    """OpenAI's folders: every section carries transformers 4's bookkeeping; eos_token_id 2 (the highest id)."""
    hf = _hf_config(eos_token_id=2, bos_token_id=0, pad_token_id=1).to_dict()
    hf["text_config"] |= TRANSFORMERS_4_SECTION
    hf["vision_config"] |= TRANSFORMERS_4_SECTION | {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    hf |= {"text_config_dict": None, "vision_config_dict": None, "transformers_version": None}
    config = clip.read_config(hf, "mean", False)
    assert (config.pooling, config.text.activation, config.vision.d_model) == ("highest_id", "quick_gelu", 48)


def test_weights_are_taken_by_name_and_strays_refused() -> None:
    tensor = torch.zeros(2)
    towers, scoring = clip.rename(
        {
            "vision_model.pre_layrnorm.weight": tensor,
            "text_model.encoder.layers.1.mlp.fc2.bias": tensor,
            "visual_projection.weight": tensor,
            "logit_scale": tensor,
            "text_model.embeddings.position_ids": torch.arange(4)[None],  # older checkpoints saved it
        }
    )
    assert set(towers) == {"vision.pre_norm.weight", "text.layers.1.mlp.fc2.bias", "vision.projection.weight"}
    assert set(scoring) == {"logit_scale"}
    with pytest.raises(ArchitectureError, match=r"unexpected weight 'classifier\.weight'"):
        clip.rename({"classifier.weight": tensor})
    with pytest.raises(ArchitectureError, match="not the positions 0, 1, 2"):
        clip.rename({"vision_model.embeddings.position_ids": torch.tensor([[0, 2, 1]])})
