"""Two-tower folders (CLIP, SigLIP) exported into a repository: its layout, the gate's figures, its graphs as served,
each tower's int8 and fp16 and what withdraws them.

The folders (tests.export.two_tower_folders) are exported once by the command line and shared. The graphs are
checked here as the server will run them: images preprocessed from the repository's own
preprocessor_config.json (service.pipeline.images), other images than the gate's, against transformers'
model of the source folder with its own processor and tokenizer.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from tokenizers import Tokenizer

from export.__main__ import main as export_main
from export.build import ExportOptions, export_model
from export.checkpoints.checkpoint import CheckpointError, load_checkpoint
from export.gate import towers as tower_gate
from export.gate.image_cases import image_cases
from export.gate.parity import GateRefused
from service.core.fidelity import FIDELITY_MIN_COSINE, VARIANT_MIN_COSINE, FidelityReference, cosines
from service.core.repository import read_model
from service.core.towers import PIXEL_VALUES
from service.pipeline.images import PREPROCESSOR_CONFIG, ImagePreprocessor
from tests.export.two_tower_folders import (
    CLIP_IMAGE_SIZE,
    PROJECTION,
    SIGLIP_IMAGE_SIZE,
    exported_two_towers,
    library_embeddings,
)

CLIP = {"width": PROJECTION, "size": CLIP_IMAGE_SIZE, "padding": "longest", "pooling": "eos_token"}
SIGLIP = {"width": 48, "size": SIGLIP_IMAGE_SIZE, "padding": "max_length", "pooling": "last_position"}
TRANSFORMERS = {"normalize": True, "library": "transformers"}
SENTENCE_TRANSFORMERS = {"normalize": False, "library": "sentence-transformers"}
FAMILIES = {
    "clip": CLIP | TRANSFORMERS,
    "siglip": SIGLIP | TRANSFORMERS,
    "clip-vocabulary": CLIP | TRANSFORMERS,
    "st-clip": CLIP | SENTENCE_TRANSFORMERS,
    "st6-clip": CLIP | SENTENCE_TRANSFORMERS,
    "st6-siglip": SIGLIP | SENTENCE_TRANSFORMERS,
}
"""Each exported model (tests.export.two_tower_folders.SOURCES) and what it is served as."""
SERVED_MAX_ABS_DIFF = 1e-4
"""The issue's bound for what a client gets against the library, in fp32 (besides cosine >= 0.9999)."""
VARIANTS = ("fp32", "int8", "fp16")
"""What the shared export publishes of each tower (int8's speed bar off: tests.export.two_tower_folders)."""
TEXT_FILES = ("model.onnx", "model.int8.onnx", "model.fp16.onnx")
IMAGE_FILES = ("image.onnx", "image.int8.onnx", "image.fp16.onnx")


@pytest.fixture(scope="module")
def exported() -> Path:
    """source/<name> (tests.export.two_tower_folders.SOURCES) and the repository they were exported into."""
    return exported_two_towers()


@pytest.mark.parametrize("name", FAMILIES)
def test_the_repository_holds_both_towers(exported: Path, name: str) -> None:
    spec = read_model(exported / "repository" / name)
    version = spec.directory / spec.version
    assert spec.variants == {variant: version / name for variant, name in zip(VARIANTS, TEXT_FILES, strict=True)}
    assert spec.image_variants == {variant: version / name for variant, name in zip(VARIANTS, IMAGE_FILES, strict=True)}
    assert spec.image_fidelity_file == spec.directory / "image_fidelity.npz"
    assert spec.image_preprocessor == spec.directory / PREPROCESSOR_CONFIG
    assert (spec.input_names, spec.output_names) == (("input_ids", "attention_mask"), ("embedding",))
    expected = FAMILIES[name]
    assert (spec.hidden_size, spec.text_padding, spec.pooling) == (
        expected["width"],
        expected["padding"],
        expected["pooling"],
    )
    assert spec.normalize == expected["normalize"]
    assert spec.tokenizer_file is not None and spec.tokenizer_file.is_file()
    assert spec.preferred_variants == {"cpu": "fp32", "cuda": "fp16"}  # fp16 meets the fidelity rule at this size


@pytest.mark.parametrize("name", FAMILIES)
def test_parity_json_records_each_towers_figures(exported: Path, name: str) -> None:
    parity = json.loads((exported / "repository" / name / "parity.json").read_text())
    assert parity["reference_library"] == FAMILIES[name]["library"]
    assert parity["withdrawn"] == {}
    image, text = parity["towers"]["image"], parity["towers"]["text"]
    described = " ".join(image["inputs"])
    for case in ("portrait", "landscape", "grey", "RGBA", "palette PNG with transparency", "GIF"):
        assert case in described
    assert image["pixel_values_vs_processor"]["max_abs_diff"] <= tower_gate.PIXEL_MAX_ABS_DIFF
    for figures in (image, text):
        assert figures["passed"] and figures["failures"] == []
        assert figures["model_vs_library"]["max_abs_diff"] <= tower_gate.MODEL_MAX_ABS_DIFF
        assert figures["graph_vs_model"]["max_abs_diff"] <= tower_gate.GRAPH_MAX_ABS_DIFF
        assert figures["graph_vs_library"]["max_abs_diff"] <= tower_gate.SERVED_MAX_ABS_DIFF
        assert figures["graph_vs_library"]["min_cosine"] >= FIDELITY_MIN_COSINE
    assert len(text["inputs"]) > 10  # the gate sentences, through the folder's tokenizer
    for variant in ("int8", "fp16"):
        figures = parity["variants"][variant]
        assert figures["passed"] and set(figures["towers"]) == {"image", "text"}
        for tower in figures["towers"].values():
            assert tower["passed"] and tower["failures"] == []
            assert tower["graph_vs_model"]["min_cosine"] >= VARIANT_MIN_COSINE[variant]
            assert "min_cosine" in tower["graph_vs_library"]
    assert parity["int8_speed"]["published"] and set(parity["int8_speed"]["towers"]) == {"image", "text"}
    assert parity["preferred_variants_basis"]["cuda"]["basis"].startswith("fp16 min cosine to the model")


def _assert_served_equal(got: np.ndarray, expected: torch.Tensor) -> None:
    assert got.shape == tuple(expected.shape)
    assert np.abs(got - expected.numpy()).max() <= SERVED_MAX_ABS_DIFF
    assert cosines(got, expected.numpy()).min() >= FIDELITY_MIN_COSINE


@pytest.mark.parametrize("name", FAMILIES)
def test_the_published_graphs_answer_as_the_library(exported: Path, name: str) -> None:
    """Images the gate did not see, through the repository's preprocessing and image graph; texts through the
    repository's tokenizer and text graph; against the library on the source folder, as the model is served."""
    spec = read_model(exported / "repository" / name)
    images = [case.data for case in image_cases(FAMILIES[name]["size"] + 3, seed=7)]
    texts = ["a photo of a cat", "Two dogs play in the snow near a red barn.", "x"]
    expected_images, expected_texts = library_embeddings(exported / "source" / name, images, texts, spec.text_padding)
    pixels = ImagePreprocessor.from_folder(spec.directory).encode(images)
    image_graph = ort.InferenceSession(str(spec.image_variants["fp32"]), providers=["CPUExecutionProvider"])
    (served_images,) = image_graph.run(["embedding"], {"pixel_values": pixels})
    _assert_served_equal(served_images, expected_images)
    tokenizer = Tokenizer.from_file(str(spec.tokenizer_file))
    tokenizer.enable_truncation(spec.max_sequence_length)
    if spec.text_padding == "max_length":
        tokenizer.enable_padding(pad_id=spec.pad_token_id, length=spec.max_sequence_length)
    else:
        tokenizer.enable_padding(pad_id=spec.pad_token_id)
    encoded = tokenizer.encode_batch(texts)
    feed = {
        "input_ids": np.array([row.ids for row in encoded], dtype=np.int64),
        "attention_mask": np.array([row.attention_mask for row in encoded], dtype=np.int64),
    }
    text_graph = ort.InferenceSession(str(spec.variants["fp32"]), providers=["CPUExecutionProvider"])
    (served_texts,) = text_graph.run(["embedding"], feed)
    _assert_served_equal(served_texts, expected_texts)
    for variant in ("int8", "fp16"):  # each variant within its own bar of the model, on inputs the gate did not see
        image_variant = ort.InferenceSession(str(spec.image_variants[variant]), providers=["CPUExecutionProvider"])
        text_variant = ort.InferenceSession(str(spec.variants[variant]), providers=["CPUExecutionProvider"])
        (variant_images,) = image_variant.run(["embedding"], {"pixel_values": pixels})
        (variant_texts,) = text_variant.run(["embedding"], feed)
        assert cosines(variant_images, expected_images.numpy()).min() >= VARIANT_MIN_COSINE[variant]
        assert cosines(variant_texts, expected_texts.numpy()).min() >= VARIANT_MIN_COSINE[variant]


def test_the_image_reference_holds_gate_images_and_the_fp32_towers_answers(exported: Path) -> None:
    """image_fidelity.npz: a few of the gate's images as the server preprocesses them, the fp32 graph's answers."""
    spec = read_model(exported / "repository" / "siglip")
    reference = FidelityReference.load(spec.image_fidelity_file, (PIXEL_VALUES,))
    gate_images = json.loads((spec.directory / "parity.json").read_text())["towers"]["image"]["inputs"]
    assert len(reference.labels) == 4 and set(reference.labels) <= set(gate_images)
    graph = ort.InferenceSession(str(spec.image_variants["fp32"]), providers=["CPUExecutionProvider"])
    (answers,) = graph.run(["embedding"], reference.feed)
    assert np.abs(answers - reference.embedding).max() <= tower_gate.GRAPH_MAX_ABS_DIFF


def test_a_variant_that_misses_a_bar_is_withdrawn_with_its_reason(
    exported: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp16 held to a cosine no graph reaches and int8 to a speed no graph reaches: both withdrawn for both towers,
    each reason naming the tower, the figure and (the gate) the row; fp32 is published and serves CUDA too."""
    monkeypatch.setattr(tower_gate, "VARIANT_MIN_COSINE", {**VARIANT_MIN_COSINE, "fp16": 1.5})
    checkpoint = load_checkpoint(exported / "source" / "clip")
    options = ExportOptions(threads=1, int8_min_speedup=100.0)
    report = export_model(checkpoint, tmp_path / "repository", options)
    withdrawn = report["withdrawn"]
    assert set(withdrawn) == {"int8", "fp16"} and set(report["variants"]) == {"fp32"}
    gate_miss = r"refused by the parity gate: image tower: graph_vs_model: cosine \S+ < 1.5 at '[^']+'; text tower: "
    assert re.match(gate_miss, withdrawn["fp16"]["reason"])
    slow = r"image tower: \S+x fp32 at 8x3x30x30 is below the 100.0x bar; text tower: \S+x fp32 at 8x\d+ is below"
    assert re.match(slow, withdrawn["int8"]["reason"])
    assert withdrawn["int8"]["towers"]["image"]["passed"]  # its gate passed: the speed bar withdrew it
    assert report["preferred_variants"] == {"cpu": "fp32", "cuda": "fp32"}
    assert report["preferred_variants_basis"]["cuda"]["basis"] == f"fp16 not published: {withdrawn['fp16']['reason']}"
    spec = read_model(tmp_path / "repository" / "clip")
    assert set(spec.variants) == set(spec.image_variants) == {"fp32"}
    assert not (spec.directory / spec.version / "image.int8.onnx").exists()


def test_a_gate_miss_refuses_the_export(exported: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bound no graph can meet: the export is refused with the tower, the figure and the image, nothing published."""
    monkeypatch.setattr(tower_gate, "GRAPH_MAX_ABS_DIFF", -1.0)
    checkpoint = load_checkpoint(exported / "source" / "clip")
    refusal = r"image tower: graph_vs_model: max \|diff\| \S+ > -1.0 at 'RGB PNG \d+x\d+'; text tower: graph_vs_model"
    with pytest.raises(GateRefused, match=refusal):
        export_model(checkpoint, tmp_path / "repository", ExportOptions(variants=("fp32",), threads=1))
    assert not (tmp_path / "repository").exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"crop_size": 40}, "makes 40x40 pixel values, the image tower takes 30x30"),
        ({"do_pad": True}, "field 'do_pad' = True is not supported"),
        (None, "No such file or directory"),
    ],
)
def test_a_preprocessor_the_towers_cannot_follow_is_refused(
    exported: Path, tmp_path: Path, capsys: pytest.CaptureFixture, change: dict | None, message: str
) -> None:
    """The command line refuses in one line naming the file, before anything is built."""
    source = shutil.copytree(exported / "source" / "clip", tmp_path / "clip")
    config_file = source / PREPROCESSOR_CONFIG
    if change is None:
        config_file.unlink()
    else:
        config_file.write_text(json.dumps(json.loads(config_file.read_text()) | change))
    status = export_main(["--source", str(source), "--repository", str(tmp_path / "repository")])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert status == 2 and message in error and str(config_file) in error
    assert not (tmp_path / "repository").exists()


def test_a_clip_module_is_taken_alone_or_with_normalize_only(exported: Path, tmp_path: Path) -> None:
    source = shutil.copytree(exported / "source" / "st-clip", tmp_path / "st-clip")
    modules = json.loads((source / "modules.json").read_text())
    normalize = {"idx": 1, "name": "1", "path": "1_Normalize", "type": "sentence_transformers.models.Normalize"}
    (source / "modules.json").write_text(json.dumps([*modules, normalize]))
    checkpoint = load_checkpoint(source)
    assert checkpoint.config.normalize and checkpoint.library_folder == source
    assert checkpoint.folder == (source / "0_CLIPModel").resolve()
    pooling = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
    (source / "modules.json").write_text(json.dumps([*modules, pooling]))
    with pytest.raises(CheckpointError, match="modules CLIPModel -> Pooling: a CLIPModel is implemented alone"):
        load_checkpoint(source)
