"""Rerankers and classifiers exported with their heads: `python -m export` end to end, per head style.

Each source is a tiny random sequence-classification model with a real tokenizer of its family
(tests.export.tiny_models). What is checked is what the server will read (config.pbtxt, parity.json,
fidelity.npz) and what the published graph answers on sentence pairs, tokenised the server's way,
against sentence-transformers' CrossEncoder on the source folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from sentence_transformers import CrossEncoder

from export.checkpoints.checkpoint import CheckpointError, load_checkpoint
from export.heads.classifier import HeadError, head_config, is_classifier
from service.core.fidelity import (
    LOGITS_FIDELITY_MAX_ABS_DIFF,
    LOGITS_MAX_ABS_DIFF,
    FidelityReference,
    compare,
    required_bar,
)
from service.core.repository import read_model
from service.core.runtime import ExecutionSettings, ModelRuntime
from service.pipeline.tokenizer import TextTokenizer
from tests.conftest import ExportedTasks
from tests.export import tiny_models

SENTENCES = tiny_models.training_sentences()
PAIRS = [(SENTENCES[0], text) for text in SENTENCES[1:12]] + [(SENTENCES[3], "A long passage, " * 30)]
SOURCES = {name: source for name, source in tiny_models.TASK_SOURCES.items() if source.task == "classify"}
"""The shared task repository's classifiers (tests/conftest.py exported_tasks): one per head style."""
FP16_SOURCE = "bert-reranker"
"""The classifier exported with every variant asked for."""


def cross_encoder_logits(folder: Path, pairs: list[tuple[str, str]]) -> np.ndarray:
    """CrossEncoder.predict's raw logits, [pairs, labels]."""
    predicted = CrossEncoder(str(folder), device="cpu").predict(pairs, activation_fn=torch.nn.Identity())
    return np.asarray(predicted, dtype=np.float32).reshape(len(pairs), -1)


@pytest.mark.parametrize("name", SOURCES)
def test_config_declares_the_task_labels_and_logits(exported_tasks: ExportedTasks, name: str) -> None:
    repository = exported_tasks.repository
    family, labels, id2label = SOURCES[name].family, SOURCES[name].labels, SOURCES[name].id2label
    spec = read_model(repository / name)
    assert spec.task == "classify" and spec.model_type == family
    assert spec.labels == tuple(id2label.values() if id2label else (f"LABEL_{i}" for i in range(labels)))
    assert [(o.name, list(o.dims)) for o in spec.config.output] == [("logits", [labels])]
    assert spec.uses_segments == (family == "bert")
    assert json.loads(spec.config.parameters["labels"].string_value) == list(spec.labels)
    assert "pooling" not in spec.config.parameters and "normalize" not in spec.config.parameters


@pytest.mark.parametrize("name", SOURCES)
def test_published_logits_equal_cross_encoder_on_pairs(exported_tasks: ExportedTasks, name: str) -> None:
    repository, sources = exported_tasks.repository, exported_tasks.sources
    spec = read_model(repository / name)
    tokenizer = TextTokenizer(spec.tokenizer_file, spec.max_sequence_length, spec.pad_token_id)
    session = ort.InferenceSession(str(spec.variants["fp32"]), providers=["CPUExecutionProvider"])
    assert [o.name for o in session.get_outputs()] == ["logits"]
    (logits,) = session.run(["logits"], tokenizer.encode_pairs(PAIRS).feed(spec.input_names))
    expected = cross_encoder_logits(sources[name], PAIRS)
    assert logits.shape == expected.shape == (len(PAIRS), len(spec.labels))
    np.testing.assert_allclose(logits, expected, atol=1e-4)
    assert (np.argsort(logits[:, 0]) == np.argsort(expected[:, 0])).all()


@pytest.mark.parametrize("name", SOURCES)
def test_parity_report_and_load_check_are_on_logits(exported_tasks: ExportedTasks, name: str) -> None:
    repository = exported_tasks.repository
    spec = read_model(repository / name)
    report = json.loads((spec.directory / "parity.json").read_text())
    assert report["task"] == "classify" and report["head"]["labels"] == list(spec.labels)
    # A classifier is published in fp32 and fp16 only, whatever is asked (bert-reranker asked for every variant).
    published = {"fp32", "fp16"} if name == FP16_SOURCE else {"fp32"}
    assert set(report["variants"]) == set(spec.variants) == published
    assert report["withdrawn"] == {}
    fp32 = report["variants"]["fp32"]
    assert fp32["passed"] and set(fp32["cases"]) == {"tokens", "sentences", "sentence_masks"}
    for figures in fp32["cases"].values():
        assert figures["max_abs_diff_logits"] <= 1e-4
    assert fp32["load_check"]["max_abs_diff"] <= fp32["load_check"]["required"]
    reference = FidelityReference.load(spec.fidelity_file)
    assert reference.output == "logits" and reference.embedding.shape[1] == len(spec.labels)
    session = ort.InferenceSession(str(spec.variants["fp32"]), providers=["CPUExecutionProvider"])
    (logits,) = session.run(["logits"], reference.feed)
    required = required_bar(reference.output, "fp32", chosen_by_default=True)
    check = compare(reference, logits, "fp32", "CPUExecutionProvider", required)
    assert check.passed and check.max_abs_diff <= 1e-4 and check.required == LOGITS_MAX_ABS_DIFF["fp32"]
    shifted = compare(reference, logits + 0.01, "fp32", "CPUExecutionProvider", required)
    assert not shifted.passed and "max logit difference" in shifted.describe()


def test_fp16_logits_are_gated_checked_at_load_and_preferred_on_cuda(exported_tasks: ExportedTasks) -> None:
    """fp16 is held to its logit bar by the gate, CrossEncoder and the check at load; CUDA prefers it under the rule."""
    spec = read_model(exported_tasks.repository / FP16_SOURCE)
    report = json.loads((spec.directory / "parity.json").read_text())
    fp16 = report["variants"]["fp16"]
    bar = LOGITS_MAX_ABS_DIFF["fp16"]
    assert fp16["passed"] and fp16["tolerance"]["max_logits_diff"] == bar
    worst = max(figures["max_abs_diff_logits"] for figures in fp16["cases"].values())
    # fp16 rounds each value to 11 significant bits: its logits move, but by far less than the bar.
    assert 1e-5 < worst <= LOGITS_FIDELITY_MAX_ABS_DIFF
    library = fp16["reference_library"]
    assert library["passed"] and library["required"] == {"max_abs_diff": bar} and library["max_abs_diff"] <= bar
    assert report["preferred_variants"] == {"cpu": "fp32", "cuda": "fp16"}
    # The rule is applied to real sentence pairs, as users send them (random token ids are gated, not ruled on).
    on_sentences = max(fp16["cases"][kind]["max_abs_diff_logits"] for kind in ("sentences", "sentence_masks"))
    basis = report["preferred_variants_basis"]["cuda"]["basis"]
    assert basis.startswith(f"fp16 max logit difference from the model {on_sentences:.3g} <= ")
    # The server's check at load, as an operator's --variant fp16 runs it on this machine's CPU.
    runtime = ModelRuntime(spec, ExecutionSettings(device="cpu", intra_op_threads=1, variant="fp16"))
    check = runtime.fidelity
    assert check is not None and check.passed and runtime.variant == "fp16"
    assert check.required == bar and 0 < check.max_abs_diff <= bar
    tokenizer = TextTokenizer(spec.tokenizer_file, spec.max_sequence_length, spec.pad_token_id)
    logits = runtime.run(tokenizer.encode_pairs(PAIRS).feed(spec.input_names), ("logits",))["logits"]
    expected = cross_encoder_logits(exported_tasks.sources[FP16_SOURCE], PAIRS)
    np.testing.assert_allclose(logits, expected, rtol=0, atol=bar)


def test_cross_encoder_folder_exports_like_its_source(tmp_path: Path) -> None:
    """A folder CrossEncoder.save wrote (modules.json, config_sentence_transformers.json) is the same classifier."""
    source = tiny_models.save_model("bert", tmp_path / "source", task="classify", num_labels=1, seed=7)
    CrossEncoder(str(source), device="cpu").save(str(tmp_path / "saved"))
    checkpoint = load_checkpoint(tmp_path / "saved")
    assert checkpoint.task == "classify" and checkpoint.head.labels == ("LABEL_0",)
    original = load_checkpoint(source)
    assert original.state_dict.keys() == checkpoint.state_dict.keys()
    assert all(torch.equal(original.state_dict[key], checkpoint.state_dict[key]) for key in original.state_dict)


def test_embedders_are_not_classifiers() -> None:
    assert not is_classifier({"architectures": ["BertModel"]})
    assert not is_classifier({})
    assert is_classifier({"architectures": ["XLMRobertaForSequenceClassification"]})


def test_labels_default_to_label_ids_and_odd_heads_are_refused() -> None:
    assert head_config({"num_labels": 2}, "bert").labels == ("LABEL_0", "LABEL_1")
    assert head_config({"id2label": {"0": "no", "1": "yes"}}, "roberta").labels == ("no", "yes")
    assert head_config({"num_labels": 1}, "distilbert").activation == "relu"
    with pytest.raises(HeadError, match="unsupported problem_type 'ranking'"):
        head_config({"num_labels": 1, "problem_type": "ranking"}, "bert")
    with pytest.raises(HeadError, match="no sequence-classification head for 't5'"):
        head_config({"num_labels": 1}, "t5")


def test_a_head_of_another_width_is_refused_in_one_line(tmp_path: Path) -> None:
    folder = tiny_models.save_model("distilbert", tmp_path / "model", task="classify", num_labels=2)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps(config | {"num_labels": 4, "id2label": {str(i): str(i) for i in range(4)}})
    )
    with pytest.raises(CheckpointError, match=r"the classifier gives 2 labels, config\.json declares 4"):
        load_checkpoint(folder)
