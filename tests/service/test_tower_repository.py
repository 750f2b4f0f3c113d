"""The two-tower layout as the server reads it (service.core.repository): what it refuses, each in one line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from protocol import model_config_pb2 as mc
from service.core.repository import (
    CONFIG_FILE,
    P_POOLING,
    RepositoryError,
    config_text,
    parse_config,
    read_model,
)
from service.core.towers import P_IMAGE_VARIANT_PREFIX, P_TEXT_PADDING
from tests.export.two_tower_folders import exported_two_towers


@pytest.fixture(scope="module")
def exported_clip() -> Path:
    """The exported tiny CLIP model's folder (shared: copy it before changing it)."""
    return exported_two_towers() / "repository" / "clip"


def _changed(source: Path, target: Path, change: dict[str, str | None], output: str | None = None) -> Path:
    """A copy of the model folder with config.pbtxt's parameters changed (None: removed) or another output added."""
    folder = shutil.copytree(source, target / source.name)
    config = parse_config((folder / CONFIG_FILE).read_text(), folder / CONFIG_FILE)
    for key, value in change.items():
        if value is None:
            del config.parameters[key]
        else:
            config.parameters[key].string_value = value
    if output is not None:
        config.output.add(name=output, data_type=mc.TYPE_FP32, dims=[-1, 24])
    (folder / CONFIG_FILE).write_text(config_text(config))
    return folder


@pytest.mark.parametrize(
    ("change", "output", "message"),
    [
        ({P_IMAGE_VARIANT_PREFIX + "fp32": "missing.onnx"}, None, "image_variant.fp32 file .*missing.onnx does not"),
        ({"image_preprocessor": None}, None, "parameter 'image_preprocessor' is missing"),
        ({"image_preprocessor": "../outside.json"}, None, "must be a path inside the model's folder"),
        ({P_TEXT_PADDING: "left"}, None, "text_padding 'left' is not one of longest, max_length"),
        ({P_POOLING: "mean"}, None, "pooling 'mean' is not one of eos_token, highest_id, last_position"),
        ({}, "last_hidden_state", r"outputs must be embedding; got \['embedding', 'last_hidden_state'\]"),
    ],
)
def test_the_layout_is_refused_where_it_does_not_hold(
    exported_clip: Path, tmp_path: Path, change: dict[str, str | None], output: str | None, message: str
) -> None:
    with pytest.raises(RepositoryError, match=message):
        read_model(_changed(exported_clip, tmp_path, change, output))


def test_without_an_image_tower_the_text_layout_holds(exported_clip: Path, tmp_path: Path) -> None:
    """The image parameters gone, the folder is a text embedder, whose outputs and pooling are a text model's."""
    folder = _changed(exported_clip, tmp_path, {P_IMAGE_VARIANT_PREFIX + "fp32": None})
    with pytest.raises(RepositoryError, match="a embed model's outputs must be last_hidden_state, embedding"):
        read_model(folder)
