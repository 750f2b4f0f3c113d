"""The two-tower layout as the server reads it (service.core.repository): what it refuses, each in one line; the
image tower's variant and its check at load (service.core.runtime)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from protocol import model_config_pb2 as mc
from service.core.repository import (
    CONFIG_FILE,
    P_POOLING,
    RepositoryError,
    config_text,
    parse_config,
    read_model,
)
from service.core.runtime import CPU, ExecutionSettings, ModelRuntime
from service.core.towers import IMAGE_FIDELITY_FILE, IMAGE_VARIANT_FILES, P_IMAGE_VARIANT_PREFIX, P_TEXT_PADDING
from service.errors import ExecutionError
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
        ({P_IMAGE_VARIANT_PREFIX + "bf16": "image.onnx"}, None, "image variant 'bf16' is not one of fp32, int8, fp16"),
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
    gone = {P_IMAGE_VARIANT_PREFIX + variant: None for variant in IMAGE_VARIANT_FILES}
    folder = _changed(exported_clip, tmp_path, gone)
    with pytest.raises(RepositoryError, match="a embed model's outputs must be last_hidden_state, embedding"):
        read_model(folder)


def _image_runtime(folder: Path, variant: str) -> ModelRuntime:
    return ModelRuntime(read_model(folder), ExecutionSettings(device="cpu", variant=variant), image=True)


@pytest.mark.parametrize("variant", ["fp32", "int8", "fp16"])
def test_the_image_tower_loads_each_variant_and_checks_it(exported_clip: Path, variant: str) -> None:
    runtime = _image_runtime(exported_clip, variant)
    assert (runtime.variant, runtime.provider) == (variant, CPU)
    assert runtime.graphs[variant].name == IMAGE_VARIANT_FILES[variant]
    check = runtime.fidelity
    assert check is not None and check.passed and check.variant == variant and len(check.worst_row) > 0


def _corrupted(exported_clip: Path, tmp_path: Path, variant: str) -> Path:
    """A copy of the model whose image graph of `variant` has noise added to its widest weight: it loads, and answers
    wrongly."""
    folder = shutil.copytree(exported_clip, tmp_path / exported_clip.name)
    graph_file = read_model(folder).image_variants[variant]
    graph = onnx.load(str(graph_file))
    widest = max(graph.graph.initializer, key=lambda tensor: np.prod(tensor.dims))
    weights = numpy_helper.to_array(widest)
    noise = np.random.default_rng(0).normal(0.0, weights.std(), size=weights.shape).astype(weights.dtype)
    widest.CopyFrom(numpy_helper.from_array(weights + noise, widest.name))
    onnx.save(graph, str(graph_file))
    return folder


def test_a_corrupted_image_graph_is_refused_at_load(exported_clip: Path, tmp_path: Path) -> None:
    """An image graph whose weights changed after the export loads, and answers wrongly: its check refuses it."""
    folder = _corrupted(exported_clip, tmp_path, "fp32")
    refusal = (
        r"model clip \(image tower\): fidelity check failed: fp32 on CPUExecutionProvider: "
        r"min cosine to the model \S+ < 0.99999 \(worst: .+\)"
    )
    with pytest.raises(ExecutionError, match=refusal):
        _image_runtime(folder, "fp32")


def test_without_an_image_reference_the_image_tower_is_served_unchecked(
    exported_clip: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A repository exported before image_fidelity.npz existed still loads; the log says it is unchecked."""
    folder = shutil.copytree(exported_clip, tmp_path / exported_clip.name)
    (folder / IMAGE_FIDELITY_FILE).unlink()
    with caplog.at_level(logging.WARNING, logger="service.core.runtime"):
        runtime = _image_runtime(folder, "fp32")
    assert runtime.fidelity is None
    assert "model clip (image tower): no fidelity reference in the repository; fp32 is served unchecked" in caplog.text


def test_an_image_tower_without_the_variant_serves_fp32(
    exported_clip: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The model's variant applies to both towers; an image tower that lacks it (an older export) falls back."""
    folder = _changed(exported_clip, tmp_path, {P_IMAGE_VARIANT_PREFIX + "int8": None})
    with caplog.at_level(logging.WARNING, logger="service.core.runtime"):
        runtime = _image_runtime(folder, "int8")
    assert runtime.variant == "fp32" and runtime.fidelity is not None and runtime.fidelity.passed
    assert "model clip: no int8 graph published for the image tower; serving fp32" in caplog.text


def test_a_default_fp16_image_graph_below_the_rule_is_replaced_by_fp32(
    exported_clip: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The text tower's fp16 chosen by default (CUDA's preference), the image tower's fp16 corrupted: as for text, the
    server serves the image tower's fp32 instead, and says so."""
    folder = _corrupted(exported_clip, tmp_path, "fp16")
    settings = ExecutionSettings(device="cpu", variant="fp16")
    with caplog.at_level(logging.WARNING, logger="service.core.runtime"):
        runtime = ModelRuntime(read_model(folder), settings, image=True, chosen_by_default=True)
    assert runtime.variant == "fp32" and runtime.fidelity is not None and runtime.fidelity.passed
    assert "model clip (image tower): FIDELITY CHECK FAILED, serving fp32 instead: fp16 on" in caplog.text
    with pytest.raises(ExecutionError, match=r"model clip \(image tower\): fidelity check failed: fp16 on"):
        _image_runtime(folder, "fp16")  # the operator's choice: held to fp16's own bar, refused


def test_without_an_image_reference_fp16_is_not_a_default(exported_clip: Path, tmp_path: Path) -> None:
    folder = shutil.copytree(exported_clip, tmp_path / exported_clip.name)
    (folder / IMAGE_FIDELITY_FILE).unlink()
    settings = ExecutionSettings(device="cpu", variant="fp16")
    assert ModelRuntime(read_model(folder), settings, image=True, chosen_by_default=True).variant == "fp32"
    assert _image_runtime(folder, "fp16").variant == "fp16"  # the operator's choice stands, unchecked
