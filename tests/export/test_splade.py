"""SPLADE sparse embedders: a SparseEncoder folder exported, served as `sparse_embedding`, equal to the library.

One tiny SPLADE folder (BERT's masked-LM head, max pooling) goes through the real command line; the
other families and SpladePooling settings are held to SparseEncoder on our PyTorch model alone.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from sentence_transformers import SparseEncoder

from export.checkpoints.checkpoint import CheckpointError, load_checkpoint
from export.gate.references.library import MASKED_LM_MAX_ABS_DIFF
from service.core.fidelity import FidelityReference, compare
from service.core.repository import read_model
from service.pipeline.tokenizer import TextTokenizer
from tests.export import tiny_models
from tests.export.test_export import run_export
from tests.vectors import assert_same_vectors

SENTENCES = tiny_models.training_sentences()[:12]
pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")  # SparseEncoder.save


@dataclass(frozen=True)
class ExportedSplade:
    """The tiny SPLADE source folder, its published model folder, and the command's result."""

    source: Path
    published: Path
    result: subprocess.CompletedProcess


@pytest.fixture(scope="module")
def splade(tmp_path_factory: pytest.TempPathFactory) -> ExportedSplade:
    """The tiny SPLADE folder exported through `python -m export` (every variant asked for: fp32 is published)."""
    folder = tmp_path_factory.mktemp("splade")
    source = tiny_models.save_sparse_encoder(folder / "source")
    repository = folder / "repository"
    result = run_export("--repository", str(repository), "--source", str(source), "--name", "splade")
    assert result.returncode == 0, result.stderr
    return ExportedSplade(source, repository / "splade", result)


def _library(source: Path, texts: list[str]) -> np.ndarray:
    """SparseEncoder's embeddings of texts, densified."""
    encoded = SparseEncoder(str(source), device="cpu").encode(texts, convert_to_tensor=True)
    return encoded.to_dense().numpy()


def test_the_folder_is_published_as_a_sparse_embedder(splade: ExportedSplade) -> None:
    spec = read_model(splade.published)
    assert (spec.task, spec.output_names, spec.vocab_size, spec.hidden_size) == (
        "sparse",
        ("sparse_embedding",),
        400,
        0,
    )
    assert spec.output_shape("sparse_embedding", 3, 17) == (3, 400)
    assert set(spec.variants) == {"fp32"} and spec.preferred_variants == {"cpu": "fp32", "cuda": "fp32"}
    assert spec.prompts == {"document": "", "query": ""} and spec.default_prompt_name == ""
    (output,) = spec.config.output
    assert (output.name, list(output.dims)) == ("sparse_embedding", [400])
    assert not {"pooling", "normalize", "similarity_fn_name", "embedding_ranges"} & set(spec.config.parameters)
    assert "splade is a sparse embedder: published in fp32 only" in splade.result.stderr


def test_parity_json_holds_the_model_to_transformers_and_the_library(splade: ExportedSplade) -> None:
    report = json.loads((splade.published / "parity.json").read_text())
    assert report["task"] == "sparse" and report["head"]["pooling_strategy"] == "max"
    masked_lm = report["masked_lm_reference"]
    assert masked_lm["class"] == "BertForMaskedLM" and masked_lm["passed"]
    assert masked_lm["max_abs_diff"] <= masked_lm["required"]["max_abs_diff"] == MASKED_LM_MAX_ABS_DIFF
    fp32 = report["variants"]["fp32"]
    for kind, figures in fp32["cases"].items():
        assert figures["min_cosine"] >= 0.99999, kind
        assert figures["max_abs_diff_sparse_embedding_relative_to_row_max"] <= 1e-4, kind
    library = fp32["reference_library"]
    assert library["class"] == "SparseEncoder" and library["passed"] and library["min_cosine"] >= 0.9999
    assert library["max_abs_diff"] <= 1e-4 and "relative to each row's largest value" in library["compared"]


def test_the_published_graph_equals_sparse_encoder(splade: ExportedSplade) -> None:
    spec = read_model(splade.published)
    session = ort.InferenceSession(str(spec.variants["fp32"]), providers=["CPUExecutionProvider"])
    tokenizer = TextTokenizer(spec.tokenizer_file, spec.max_sequence_length, spec.pad_token_id)
    (served,) = session.run(["sparse_embedding"], tokenizer.encode(SENTENCES).feed(spec.input_names))
    expected = _library(splade.source, SENTENCES)
    assert_same_vectors(served, expected, min_cosine=0.9999)
    assert np.abs(served - expected).max() <= 1e-4
    assert np.array_equal(served > 0, expected > 0)
    assert 0 < (expected > 0).sum(axis=1).max() < spec.vocab_size // 2  # sparse: a mask leak would add terms
    # The server's check at load passes on this graph.
    fidelity = FidelityReference.load(spec.fidelity_file)
    assert fidelity.output == "sparse_embedding"
    (answer,) = session.run(["sparse_embedding"], fidelity.feed)
    assert compare(fidelity, answer, "fp32", "CPUExecutionProvider", 0.99999).passed


@pytest.mark.parametrize(
    ("family", "settings"),
    [
        ("bert", {"pooling_strategy": "sum", "activation_function": "log1p_relu"}),
        ("bert", {"tie_word_embeddings": False}),
        ("roberta", {}),
        ("xlm-roberta", {"pooling_strategy": "sum"}),
        ("distilbert", {"activation_function": "log1p_relu"}),
        ("mpnet", {}),
    ],
)
def test_each_masked_lm_family_and_pooling_equals_sparse_encoder(tmp_path: Path, family: str, settings: dict) -> None:
    source = tiny_models.save_sparse_encoder(tmp_path, family=family, **settings)
    checkpoint = load_checkpoint(source)
    assert checkpoint.head.tied_decoder is settings.get("tie_word_embeddings", True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(source))
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    names = ["input_ids", "attention_mask"] + (["token_type_ids"] if checkpoint.config.uses_segments else [])
    with torch.inference_mode():
        ours = checkpoint.build_model()(**{name: batch[name] for name in names}).numpy()
    expected = _library(source, SENTENCES)
    assert np.abs(ours - expected).max() <= 1e-5
    assert np.array_equal(ours > 0, expected > 0) and (expected > 0).any()


def _edit(path: Path, **fields: object) -> None:
    path.write_text(json.dumps(json.loads(path.read_text()) | fields))


@pytest.fixture
def folder(tmp_path: Path, splade: ExportedSplade) -> Path:
    """A private copy of the SPLADE source folder that a test may change."""
    return Path(shutil.copytree(splade.source, tmp_path / "model"))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"pooling_strategy": "mean"}, "SpladePooling 'mean' with 'relu' is not supported"),
        ({"activation_function": "gelu"}, "SpladePooling 'max' with 'gelu' is not supported"),
        ({"embedding_dimension": 512}, "embedding dimension 512 is not the vocabulary's size 400"),
        ({"top_k": 32}, "SpladePooling field 'top_k' is not implemented here"),
    ],
)
def test_splade_pooling_not_implemented_is_refused_naming_it(folder: Path, change: dict, message: str) -> None:
    path = folder / "1_SpladePooling" / "config.json"
    _edit(path, **change)
    with pytest.raises(CheckpointError) as refusal:
        load_checkpoint(folder)
    assert str(refusal.value).startswith(f"{path}: ") and message in str(refusal.value)
    assert "\n" not in str(refusal.value)


def test_a_missing_masked_lm_head_weight_is_refused_naming_it(folder: Path) -> None:
    weights = load_file(str(folder / "model.safetensors"))
    del weights["cls.predictions.transform.dense.weight"]
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError) as refusal:
        load_checkpoint(folder)
    assert str(refusal.value) == f"{folder}: masked-LM head weight 'cls.predictions.transform.dense.weight' is missing"


def test_another_sparse_module_is_refused_naming_it(folder: Path) -> None:
    """SparseStaticEmbedding (inference-free SPLADE's document side) is not an MLMTransformer + SpladePooling."""
    modules_file = folder / "modules.json"
    static = "sentence_transformers.sparse_encoder.modules.sparse_static_embedding.SparseStaticEmbedding"
    modules = json.loads(modules_file.read_text())
    modules_file.write_text(json.dumps([modules[0] | {"type": static}, modules[1]]))
    repository = folder.parent / "repository"
    result = run_export("--repository", str(repository), "--source", str(folder), "--variants", "fp32")
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"export: error: {modules_file}: module type not implemented here: '{static}' at path ''")
    assert "or a SparseEncoder's MLMTransformer then SpladePooling" in line
    assert not repository.exists()
