"""The served tokenizer is the one the reference library runs, and a folder whose file differs is said so at export.

The held-out case: an XLM-R cross-encoder whose tokenizer.json declares an NFKC normaliser, which
transformers 5's XLMRobertaTokenizer leaves out (`…` stays one token there, three `.` through the
file; full-width letters and ligatures are unknown there and ASCII through the file).
"""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path

import onnxruntime as ort
import pytest
import torch
from sentence_transformers import CrossEncoder
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from export.build import ExportOptions, export_model
from export.checkpoints.checkpoint import load_checkpoint
from export.checkpoints.library_tokenizer import PROBE_TEXTS, LibraryTokenizerError, with_library_tokenizer
from export.gate.cases import SENTENCES_FILE
from service.core.repository import read_model
from service.pipeline.tokenizer import TextTokenizer
from tests.export import tiny_models

TEXTS = [*PROBE_TEXTS, "Ｈｅｌｌｏ ｗｏｒｌｄ", "the ﬁrst ﬂoor… or the ﬀth?"]  # noqa: RUF001  (full-width letters, meant)
"""Texts with `…`, full-width letters and ligatures: tokenised differently by the file and by the library."""


def _nfkc_cross_encoder(folder: Path) -> Path:
    """A tiny XLM-R cross-encoder whose tokenizer.json declares NFKC and whose tokenizer_config.json names
    XLMRobertaTokenizer, as the held-out folder does."""
    tiny_models.save_model("xlm-roberta", folder, task="classify", num_labels=1)
    tokenizer_file = folder / "tokenizer.json"
    tokenizer_file.write_text(json.dumps(json.loads(tokenizer_file.read_text()) | {"normalizer": {"type": "NFKC"}}))
    settings = folder / "tokenizer_config.json"
    settings.write_text(json.dumps(json.loads(settings.read_text()) | {"tokenizer_class": "XLMRobertaTokenizer"}))
    return folder


def _library_ids(folder: Path, inputs: list) -> list[list[int]]:
    """CrossEncoder's token ids for each input (a text or a pair), as it tokenises them."""
    tokenizer = CrossEncoder(str(folder), device="cpu", local_files_only=True).tokenizer
    return [tokenizer(*(item if isinstance(item, tuple) else (item,)))["input_ids"] for item in inputs]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict, list[str]]:
    """The NFKC folder exported in fp32 (gate sentences: a few, then TEXTS): source, published folder, report, log."""
    root = tmp_path_factory.mktemp("nfkc")
    source = _nfkc_cross_encoder(root / "source")
    sentences = root / "sentences.txt"
    sentences.write_text("\n".join([*tiny_models.training_sentences()[:8], *TEXTS]) + "\n")
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("export")
    logger.addHandler(handler)
    try:
        report = export_model(
            load_checkpoint(source, name="nfkc"),
            root / "repository",
            ExportOptions(variants=("fp32",), sentences=sentences),
        )
    finally:
        logger.removeHandler(handler)
    return source, root / "repository" / "nfkc", report, [record.getMessage() for record in records]


def test_the_folders_file_and_the_library_differ_on_these_texts(exported: tuple[Path, Path, dict, list[str]]) -> None:
    source = exported[0]
    file_tokenizer = Tokenizer.from_file(str(source / "tokenizer.json"))
    library = _library_ids(source, TEXTS)
    assert all(file_tokenizer.encode(text).ids != ids for text, ids in zip(TEXTS, library, strict=True))


def test_the_served_tokenizer_is_cross_encoders(exported: tuple[Path, Path, dict, list[str]]) -> None:
    source, published, report, _ = exported
    spec = read_model(published)
    served = TextTokenizer.of_model(spec)
    pairs = list(itertools.pairwise(TEXTS))
    library = _library_ids(source, [*TEXTS, *pairs])
    singles, paired = served.encode(TEXTS), served.encode_pairs(pairs)
    rows = [
        (ids, mask)
        for batch in (singles, paired)
        for ids, mask in zip(batch.input_ids, batch.attention_mask, strict=True)
    ]
    assert [ids[mask == 1].tolist() for ids, mask in rows] == library
    assert report["variants"]["fp32"]["reference_library"]["passed"]


def test_the_export_says_so_in_one_line(exported: tuple[Path, Path, dict, list[str]]) -> None:
    source, _, _, warnings = exported
    (notice,) = [message for message in warnings if "tokenizer.json" in message]
    assert "\n" not in notice and str(source) in notice and "XLMRobertaTokenizer" in notice
    assert "differs in normalizer" in notice
    # The first gate input that tokenises differently, and both token sequences.
    assert "first at input 9: " + repr(TEXTS[0]) in notice
    file_tokens = Tokenizer.from_file(str(source / "tokenizer.json")).encode(TEXTS[0]).tokens
    library_tokens = CrossEncoder(str(source), device="cpu", local_files_only=True).tokenizer.tokenize(
        TEXTS[0], add_special_tokens=True
    )
    assert f"tokenizer.json {file_tokens}, the library {library_tokens}" in notice


def test_a_folder_whose_file_the_library_runs_keeps_its_file(tmp_path: Path) -> None:
    source = tiny_models.save_model("xlm-roberta", tmp_path / "plain", task="classify", num_labels=1)
    checkpoint = load_checkpoint(source)
    assert with_library_tokenizer(checkpoint, tmp_path, SENTENCES_FILE) is checkpoint


def test_a_folder_whose_tokenizer_transformers_cannot_load_is_refused(tmp_path: Path) -> None:
    source = tiny_models.save_model("bert", tmp_path / "broken")
    checkpoint = load_checkpoint(source)
    (source / "tokenizer_config.json").write_text("{")  # broken after the exporter read it: only transformers sees it
    with pytest.raises(LibraryTokenizerError, match=f"transformers could not load the tokenizer of {source}: "):
        with_library_tokenizer(checkpoint, tmp_path, SENTENCES_FILE)


def test_served_logits_equal_cross_encoders_on_these_texts(exported: tuple[Path, Path, dict, list[str]]) -> None:
    """The published graph fed by the served tokenizer answers CrossEncoder's logits on the texts the file misreads."""
    source, published, _, _ = exported
    spec = read_model(published)
    session = ort.InferenceSession(str(spec.variants["fp32"]), providers=["CPUExecutionProvider"])
    pairs = list(itertools.pairwise(TEXTS))
    feed = TextTokenizer.of_model(spec).encode_pairs(pairs).feed(spec.input_names)
    (logits,) = session.run(["logits"], feed)
    cross_encoder = CrossEncoder(str(source), device="cpu", local_files_only=True)
    expected = cross_encoder.predict(pairs, activation_fn=torch.nn.Identity(), show_progress_bar=False)
    assert abs(logits.reshape(-1) - expected.reshape(-1)).max() <= 1e-4


def test_a_folder_with_a_vocabulary_and_no_tokenizer_json_is_served_the_librarys_pipeline(tmp_path: Path) -> None:
    """A BERT folder with vocab.txt only (as older checkpoints ship it): transformers' pipeline is published."""
    source = tiny_models.save_model("bert", tmp_path / "source")
    vocabulary = json.loads((source / "tokenizer.json").read_text())["model"]["vocab"]
    by_id = sorted(vocabulary, key=vocabulary.__getitem__)
    (source / "vocab.txt").write_text("".join(f"{token}\n" for token in by_id))
    (source / "tokenizer.json").unlink()
    texts = tiny_models.training_sentences()[:8]
    sentences = tmp_path / "sentences.txt"
    sentences.write_text("\n".join(texts) + "\n")
    options = ExportOptions(variants=("fp32",), sentences=sentences)
    report = export_model(load_checkpoint(source, name="vocabulary"), tmp_path / "repository", options)
    published = tmp_path / "repository" / "vocabulary"
    assert (published / "tokenizer.json").is_file()
    served = TextTokenizer.of_model(read_model(published)).encode(texts)
    library = AutoTokenizer.from_pretrained(str(source))
    assert [ids[mask == 1].tolist() for ids, mask in zip(served.input_ids, served.attention_mask, strict=True)] == [
        library(text)["input_ids"] for text in texts
    ]
    assert report["variants"]["fp32"]["reference_library"]["passed"]
