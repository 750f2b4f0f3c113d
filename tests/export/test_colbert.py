"""ColBERT models as PyLate saves them: exported as task multivector, their vectors equal to PyLate's own.

The model is made by PyLate and exported once for every test (tests.multivector_models); the
export's own gate, against sentence-transformers' MultiVectorEncoder, runs in the export.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from tokenizers import Tokenizer

from export.checkpoints.checkpoint import CheckpointError, load_checkpoint
from service.core.repository import MultiVectorSpec, read_model
from service.pipeline import multivector
from service.pipeline.tokenizer import TextTokenizer
from tests.multivector_models import DOCUMENT_LENGTH, QUERY_LENGTH, WIDTH, ExportedColbert
from tests.vectors import assert_same_vectors


def test_the_folder_is_published_as_a_multivector_model(colbert: ExportedColbert) -> None:
    spec = read_model(colbert.published)
    assert (spec.task, spec.output_names, spec.multivector_width) == ("multivector", ("token_vectors",), WIDTH)
    assert set(spec.variants) == {"fp32"}
    (output,) = spec.config.output
    assert (output.name, list(output.dims)) == ("token_vectors", [-1, WIDTH])
    tokenizer = Tokenizer.from_file(str(spec.tokenizer_file))
    punctuation = json.loads((colbert.source / "config_sentence_transformers.json").read_text())["skiplist_words"]
    assert spec.multivector == MultiVectorSpec(
        score="sum",
        query_prefix_id=tokenizer.token_to_id("[Q] "),
        document_prefix_id=tokenizer.token_to_id("[D] "),
        query_length=QUERY_LENGTH,
        document_length=DOCUMENT_LENGTH,
        query_expansion_id=tokenizer.token_to_id("[MASK]"),
        attend_to_expansion_tokens=False,
        document_skip_ids=tuple(sorted(i for i in map(tokenizer.token_to_id, punctuation) if i is not None)),
    )
    assert None not in (spec.multivector.query_prefix_id, spec.multivector.document_prefix_id)
    assert spec.multivector.document_skip_ids  # some punctuation is in the tiny vocabulary, some is not
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
    ],
)
def test_what_is_not_implemented_is_refused(
    colbert: ExportedColbert, tmp_path: Path, file: str, changes: dict, refusal: str
) -> None:
    folder = _edited_copy(colbert.source, tmp_path / "edited", file, **changes)
    with pytest.raises(CheckpointError, match=refusal):
        load_checkpoint(folder)
