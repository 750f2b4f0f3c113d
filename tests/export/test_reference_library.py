"""The gate's last reference: sentence-transformers on the source folder against every published variant.

A folder the exporter reads one way and the library another is refused, even when every graph equals
our own PyTorch reading of it; the figures of every export are in parity.json. A folder whose
tokenizer.json the library runs otherwise is served with the library's tokenizer (export.checkpoints.library_tokenizer).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from sentence_transformers import SentenceTransformer

from export.checkpoints.checkpoint import load_checkpoint
from export.gate.cases import read_sentences
from export.gate.references.library import (
    FP32_MAX_ABS_DIFF,
    LONG_TEXT_LABEL,
    library_reference,
    measure,
    published_check,
)
from export.graph.onnx_export import export_onnx, input_names
from service.core.repository import read_model
from service.pipeline.tokenizer import TextTokenizer
from tests.conftest import DEFAULT_MODEL, TINY_MODEL, ExportedTasks
from tests.export import tiny_models
from tests.export.test_export import run_export

SENTENCES = read_sentences()
GATE_ROWS = len(SENTENCES) + 1
"""The gate sentences and all of them as one text (longer than the model's window)."""


def _not_lower_casing(folder: Path) -> None:
    """tokenizer_config.json says do_lower_case false over a lower-casing tokenizer.json.

    transformers rebuilds the normaliser from it (so sentence-transformers keeps the case, and the
    tiny lower-case vocabulary gives [UNK] for capitals); tokenizer.json as it is lower-cases. The
    exporter does not read this field: the library's tokenizer is what shows the difference.
    """
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"do_lower_case": False}))


def test_a_folder_the_library_tokenises_otherwise_is_served_as_the_library_tokenises_it(tmp_path: Path) -> None:
    source = tiny_models.save_sentence_transformer("bert", tmp_path / "source")
    _not_lower_casing(source)
    repository = tmp_path / "repository"
    repository.mkdir()
    result = run_export(
        "--repository", str(repository), "--source", str(source), "--name", "cased", "--variants", "fp32"
    )
    assert result.returncode == 0, result.stderr
    (notice,) = [line for line in result.stderr.splitlines() if "tokenizer.json is not what transformers'" in line]
    assert "BertTokenizer runs (it differs in normalizer)" in notice and "first at input 1: " in notice
    spec = read_model(repository / "cased")
    library = SentenceTransformer(str(source), device="cpu", local_files_only=True).tokenizer
    served = TextTokenizer.of_model(spec).encode(SENTENCES[:20])
    assert [ids[mask == 1].tolist() for ids, mask in zip(served.input_ids, served.attention_mask, strict=True)] == [
        library(text)["input_ids"] for text in SENTENCES[:20]
    ]
    assert _library_figures(repository / "cased")["fp32"]["passed"]


@pytest.fixture(scope="module")
def reranker(exported_tasks: ExportedTasks) -> tuple[Path, ort.InferenceSession, TextTokenizer]:
    """The shared repository's BERT reranker: its source folder, its published fp32 session, its tokenizer."""
    spec = read_model(exported_tasks.repository / "bert-reranker")
    session = ort.InferenceSession(str(spec.variants["fp32"]), providers=["CPUExecutionProvider"])
    tokenizer = TextTokenizer(spec.tokenizer_file, spec.max_sequence_length, spec.pad_token_id)
    return exported_tasks.sources["bert-reranker"], session, tokenizer


def _measure_reranker(folder: Path, session: ort.InferenceSession, tokenizer: TextTokenizer) -> object:
    checkpoint = load_checkpoint(folder)
    reference = library_reference(checkpoint, SENTENCES[:20])
    assert reference.model_class == "CrossEncoder" and reference.output == "logits"
    names = [i.name for i in session.get_inputs()]
    return measure(
        reference,
        "fp32",
        session,
        tokenizer,
        names,
        max_length=checkpoint.max_seq_length,
        pad_token_id=checkpoint.config.pad_token_id,
    )


def test_a_reranker_is_held_to_cross_encoder_logits(
    tmp_path: Path, reranker: tuple[Path, ort.InferenceSession, TextTokenizer]
) -> None:
    source, session, tokenizer = reranker
    figures = _measure_reranker(source, session, tokenizer)
    assert not figures.failures and figures.min_cosine is None and figures.max_abs_diff <= FP32_MAX_ABS_DIFF
    assert figures.rows == 21 and figures.required == {"max_abs_diff": FP32_MAX_ABS_DIFF}
    cased = Path(shutil.copytree(source, tmp_path / "cased"))
    _not_lower_casing(cased)
    (failure,) = _measure_reranker(cased, session, tokenizer).failures
    assert failure.startswith("fp32: logits max |diff| ")
    assert "to sentence-transformers' CrossEncoder on the folder at input" in failure


def test_a_plain_folder_is_compared_after_normalising_both(tmp_path: Path) -> None:
    """No modules.json: sentence-transformers mean-pools without normalising; the exporter normalises."""
    folder = tiny_models.save_model("bert", tmp_path / "plain")
    checkpoint = load_checkpoint(folder)
    model = checkpoint.build_model()
    export_onnx(model, tmp_path / "model.onnx")
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    tokenizer = TextTokenizer(folder / "tokenizer.json", checkpoint.max_seq_length, checkpoint.config.pad_token_id)
    reference = library_reference(checkpoint, SENTENCES[:12])
    assert reference.normalized and "after L2-normalising both" in reference.describe()
    assert reference.labels[-1] == LONG_TEXT_LABEL
    assert np.abs(np.linalg.norm(reference.expected, axis=1) - 1).min() > 0.01  # the library's are not unit vectors
    arguments = (session, tokenizer, input_names(model.config))
    lengths = {"max_length": checkpoint.max_seq_length, "pad_token_id": checkpoint.config.pad_token_id}
    figures = measure(reference, "fp32", *arguments, **lengths)
    assert not figures.failures and figures.min_cosine >= 0.9999 and figures.max_abs_diff <= FP32_MAX_ABS_DIFF
    # Compared as they are, the direction agrees and the values do not: the library's vectors are not normalised.
    (failure,) = measure(dataclasses.replace(reference, normalized=False), "fp32", *arguments, **lengths).failures
    assert failure.startswith("fp32: embedding max |diff| ")


def test_a_folder_the_library_cannot_answer_for_is_refused(tmp_path: Path, exported_tasks: ExportedTasks) -> None:
    """A RoBERTa tokenizer without a real limit: sentence-transformers caps it at max_position_embeddings, which
    RoBERTa's positions (counted after the padding id) overrun on a long text; the exporter serves 2 fewer tokens."""
    source = Path(shutil.copytree(exported_tasks.sources["roberta-embed"], tmp_path / "unbounded"))
    config = source / "tokenizer_config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"model_max_length": 10**30}))
    checkpoint = load_checkpoint(source)
    spec = read_model(exported_tasks.repository / "roberta-embed")
    session = ort.InferenceSession(str(spec.variants["fp32"]), providers=["CPUExecutionProvider"])
    tokenizer = TextTokenizer(spec.tokenizer_file, spec.max_sequence_length, spec.pad_token_id)
    check = published_check(checkpoint, tokenizer, list(spec.input_names), SENTENCES)
    figures, failures = check("fp32", session)
    (failure,) = failures
    assert failure.startswith(f"sentence-transformers could not answer for {source}: RuntimeError: index ")
    assert figures == {"library": None, "reason": failure}


def _library_figures(directory: Path) -> dict[str, dict]:
    report = json.loads((directory / "parity.json").read_text())
    return {variant: figures["reference_library"] for variant, figures in report["variants"].items()}


@pytest.mark.parametrize("name", tiny_models.TASK_SOURCES)
def test_every_exported_task_records_the_library_figures(exported_tasks: ExportedTasks, name: str) -> None:
    task = tiny_models.TASK_SOURCES[name].task
    figures = _library_figures(exported_tasks.repository / name)["fp32"]  # the BERT reranker has fp16 too
    assert figures["library"].startswith("sentence-transformers 6.")
    assert figures["class"] == {"embed": "SentenceTransformer", "classify": "CrossEncoder"}[task]
    assert figures["passed"] and figures["rows"] == GATE_ROWS and figures["provider"] == "CPUExecutionProvider"
    assert figures["max_abs_diff"] <= figures["required"]["max_abs_diff"] == FP32_MAX_ABS_DIFF
    if task == "embed":
        assert figures["min_cosine"] >= figures["required"]["min_cosine"] == 0.9999
        assert "default prompt applied" in figures["compared"] and "normalising" not in figures["compared"]
    else:
        assert "min_cosine" not in figures and "logits" in figures["compared"]


def test_the_default_model_meets_the_library_in_every_variant(default_repository: Path) -> None:
    figures = _library_figures(default_repository / DEFAULT_MODEL)
    assert set(figures) == {"fp32", "int8", "fp16"}
    for variant, measured in figures.items():
        assert measured["class"] == "SentenceTransformer" and measured["rows"] == GATE_ROWS, variant
        assert measured["passed"] and measured["min_cosine"] >= measured["required"]["min_cosine"], variant
    assert figures["fp32"]["min_cosine"] >= 0.99999 and figures["fp32"]["max_abs_diff"] <= FP32_MAX_ABS_DIFF


def test_a_random_model_says_it_has_no_library_reference(tiny_repository: Path) -> None:
    (figures,) = _library_figures(tiny_repository / TINY_MODEL).values()
    assert figures == {"library": None, "reason": "random initialisation: there is no folder for a library to load"}
