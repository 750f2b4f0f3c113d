"""ColBERT models as PyLate saves them: exported as task multivector, their vectors equal to PyLate's own.

The model is made by PyLate and exported once for every test (tests.multivector_models); the
export's own gate, against sentence-transformers' MultiVectorEncoder, runs in the export.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from sentence_transformers import MultiVectorEncoder
from tokenizers import Tokenizer

from export.checkpoints.checkpoint import CheckpointError, load_checkpoint
from export.gate.references.multivector import follow_pylate
from service.core.repository import read_model
from service.core.text_rules import MultiVectorSpec
from service.pipeline import multivector
from service.pipeline.tokenizer import TextTokenizer
from tests.multivector_models import DOCUMENT_LENGTH, QUERY_LENGTH, UNKNOWN_TEXTS, WIDTH, ExportedColbert
from tests.vectors import assert_same_vectors


def test_the_folder_is_published_as_a_multivector_model(colbert: ExportedColbert) -> None:
    spec = read_model(colbert.published)
    assert (spec.task, spec.output_names, spec.multivector_width) == ("multivector", ("token_vectors",), WIDTH)
    assert set(spec.variants) == {"fp32"}
    (output,) = spec.config.output
    assert (output.name, list(output.dims)) == ("token_vectors", [-1, WIDTH])
    tokenizer = Tokenizer.from_file(str(spec.tokenizer_file))
    punctuation = json.loads((colbert.source / "config_sentence_transformers.json").read_text())["skiplist_words"]
    unknown = tokenizer.token_to_id("[UNK]")
    # PyLate's reading: a word missing from the vocabulary is [UNK] (transformers' convert_tokens_to_ids).
    skip_ids = {unknown if tokenizer.token_to_id(word) is None else tokenizer.token_to_id(word) for word in punctuation}
    assert spec.multivector == MultiVectorSpec(
        score="sum",
        query_prefix_id=tokenizer.token_to_id("[Q] "),
        document_prefix_id=tokenizer.token_to_id("[D] "),
        query_length=QUERY_LENGTH,
        document_length=DOCUMENT_LENGTH,
        query_expansion_id=tokenizer.token_to_id("[MASK]"),
        attend_to_expansion_tokens=False,
        document_skip_ids=tuple(sorted(skip_ids)),
    )
    assert None not in (spec.multivector.query_prefix_id, spec.multivector.document_prefix_id)
    # Some punctuation is in the tiny vocabulary, some is not: [UNK] is skipped too.
    assert len(spec.multivector.document_skip_ids) > 1 and unknown in spec.multivector.document_skip_ids
    assert spec.prompts == {"query": "", "document": ""} and not spec.similarity_fn_name


def test_parity_json_holds_the_graph_to_multivector_encoder(colbert: ExportedColbert) -> None:
    report = json.loads((colbert.published / "parity.json").read_text())
    assert report["task"] == "multivector" and report["head"]["dense"]["out_features"] == WIDTH
    fp32 = report["variants"]["fp32"]
    for kind, figures in fp32["cases"].items():
        assert figures["min_cosine"] >= 0.99999 and figures["max_abs_diff_token_vectors_attended"] <= 1e-4, kind
    library = fp32["reference_library"]
    assert library["class"] == "MultiVectorEncoder" and library["passed"] and library["min_cosine"] >= 0.9999
    assert library["max_abs_diff"] <= 1e-4 and library["maxsim_max_abs_diff"] <= 1e-4
    assert "PyLate's skip list" in library["compared"]


def _served(spec, session: ort.InferenceSession, texts: list[str], input_type: str) -> list[np.ndarray]:
    """Each text's kept vectors as the server makes them, the texts in one batch."""
    tokenizer = TextTokenizer(spec.tokenizer_file, spec.max_sequence_length, spec.pad_token_id)
    rows = multivector.tokenized(tokenizer, spec, texts, input_type)
    feed = rows.padded(spec.pad_token_id)
    (vectors,) = session.run(["token_vectors"], {name: feed[name] for name in spec.input_names})
    return multivector.row_vectors(vectors, multivector.kept_positions(rows, spec.multivector, input_type))


def test_served_vectors_and_scores_equal_pylate(colbert: ExportedColbert) -> None:
    spec = read_model(colbert.published)
    session = ort.InferenceSession(str(spec.variants["fp32"]), providers=["CPUExecutionProvider"])
    queries = _served(spec, session, colbert.texts, multivector.QUERY)
    documents = _served(spec, session, colbert.texts, multivector.DOCUMENT)
    for name, served in (("query", queries), ("document", documents)):
        for index, ours in enumerate(served):
            theirs = colbert.pylate[f"{name}{index}"]
            assert ours.shape == theirs.shape, (name, index)
            assert_same_vectors(ours, theirs, min_cosine=0.9999)
            assert np.abs(ours - theirs).max() <= 1e-4, (name, index)
    assert all(len(query) == QUERY_LENGTH for query in queries)  # the expansion's vectors are kept
    assert len(documents[-1]) <= DOCUMENT_LENGTH < len(colbert.texts[-1].split())  # truncated
    scores = np.array([[multivector.maxsim(q, d, "sum") for d in documents] for q in queries])
    assert np.abs(scores - colbert.pylate["scores"]).max() <= 1e-4


def test_a_documents_unknown_tokens_are_dropped_as_pylate_drops_them(colbert: ExportedColbert) -> None:
    """Texts with characters the vocabulary lacks: the served document vectors are PyLate's, [UNK] tokens dropped;
    MultiVectorEncoder as it reads the folder keeps them, and follows PyLate once its skip list is PyLate's."""
    spec = read_model(colbert.published)
    session = ort.InferenceSession(str(spec.variants["fp32"]), providers=["CPUExecutionProvider"])
    texts = list(UNKNOWN_TEXTS)
    indexes = [colbert.texts.index(text) for text in texts]
    served = _served(spec, session, texts, multivector.DOCUMENT)
    unknown = Tokenizer.from_file(str(spec.tokenizer_file)).token_to_id("[UNK]")
    keeping = dataclasses.replace(
        spec,
        multivector=dataclasses.replace(
            spec.multivector, document_skip_ids=tuple(i for i in spec.multivector.document_skip_ids if i != unknown)
        ),
    )
    kept = _served(keeping, session, texts, multivector.DOCUMENT)
    encoder = MultiVectorEncoder(str(colbert.source), device="cpu", local_files_only=True)
    as_read = encoder.encode_document(texts, convert_to_numpy=True, show_progress_bar=False)
    follow_pylate(encoder)
    as_pylate = encoder.encode_document(texts, convert_to_numpy=True, show_progress_bar=False)
    for row, index in enumerate(indexes):
        theirs = colbert.pylate[f"document{index}"]
        assert served[row].shape == theirs.shape and np.abs(served[row] - theirs).max() <= 1e-4, texts[row]
        assert len(kept[row]) > len(theirs) == len(as_pylate[row]) < len(as_read[row]) == len(kept[row]), texts[row]


def _edited_copy(source: Path, target: Path, file: str, **changes: object) -> Path:
    shutil.copytree(source, target)
    settings = json.loads((target / file).read_text())
    (target / file).write_text(json.dumps(settings | changes))
    return target


@pytest.mark.parametrize(
    ("file", "changes", "refusal"),
    [
        ("1_Dense/config.json", {"activation_function": "torch.nn.modules.activation.Tanh"}, "activation_function"),
        ("1_Dense/config.json", {"in_features": 16}, "in_features 16 is not the encoder's hidden size"),
        ("config_sentence_transformers.json", {"model_type": "SentenceTransformer"}, "PyLate's Dense only with"),
        ("config_sentence_transformers.json", {"prompts": {"query": "query: "}}, "prompts on a ColBERT model"),
        ("tokenizer_config.json", {"unk_token": None}, "names no unknown token of it: PyLate's skip list"),
    ],
)
def test_what_is_not_implemented_is_refused(
    colbert: ExportedColbert, tmp_path: Path, file: str, changes: dict, refusal: str
) -> None:
    folder = _edited_copy(colbert.source, tmp_path / "edited", file, **changes)
    with pytest.raises(CheckpointError, match=refusal):
        load_checkpoint(folder)
