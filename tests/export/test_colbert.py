"""ColBERT models as PyLate saves them: exported as task multivector, served vectors equal to PyLate's own.

PyLate (the library that makes these folders) cannot run beside the project's sentence-transformers
6.2, so it is installed apart, with its own pins, into .test-cache/ (once per pin list and interpreter),
and runs in a subprocess: it makes the tiny ColBERT folder from a tiny BERT, and answers
`encode(is_query=True/False)` and `colbert_scores` for texts the tokenizer knows every word of
(PyLate maps an unknown skiplist word to [UNK] and drops [UNK] tokens; the export, as
sentence-transformers reads the folder, does not: export.colbert). The export's own gate, against
sentence-transformers' MultiVectorEncoder, runs in the export.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from tokenizers import Tokenizer

from export.checkpoint import CheckpointError, load_checkpoint
from export.pipeline import ExportOptions, export_model
from service.core.repository import MultiVectorSpec, read_model
from service.pipeline import multivector
from service.pipeline.tokenizer import TextTokenizer
from tests.export import tiny_models
from tests.installs import pip_install
from tests.servers import ROOT
from tests.vectors import assert_same_vectors

PYLATE_PINS = (
    "sentence-transformers==5.3.0",
    "transformers==5.3.0",
    "pylate==1.6.0",
    "huggingface-hub>=1.3,<2",
    "tokenizers==0.22.2",
    "httpx",
    "httpcore",
)
"""PyLate 1.6.0 with what it runs with (not the project's sentence-transformers 6.2); torch and the rest: the venv's."""
INSTALLED_MARK = ".installed"
QUERY_LENGTH, DOCUMENT_LENGTH, WIDTH = 12, 20, 16
PYLATE_SCRIPT = """
import json, sys
import numpy as np
from pylate import models, scores

base, target, texts_file, answers = sys.argv[1:]
made = models.ColBERT(model_name_or_path=base, embedding_size={width}, query_length={query_length},
                      document_length={document_length}, device="cpu")
made.save(target)
model = models.ColBERT(target, device="cpu")
texts = json.loads(open(texts_file).read())
queries = model.encode(texts, is_query=True)
documents = model.encode(texts, is_query=False)
out = {{f"query{{i}}": v for i, v in enumerate(queries)}} | {{f"document{{i}}": v for i, v in enumerate(documents)}}
out["scores"] = np.array([[float(scores.colbert_scores([q], [d])[0, 0]) for d in documents] for q in queries])
np.savez(answers, **out)
"""


@pytest.fixture(scope="module")
def pylate_path() -> Path:
    """A folder holding PyLate and its pins (pip --target), for PYTHONPATH; cached under .test-cache/."""
    key = hashlib.sha256("\n".join((*PYLATE_PINS, sys.executable)).encode()).hexdigest()[:16]
    target = ROOT / ".test-cache" / f"pylate-overlay-{key}"
    if not (target / INSTALLED_MARK).is_file():
        shutil.rmtree(target, ignore_errors=True)
        pip_install(Path(sys.executable), "--no-deps", "--target", str(target), *PYLATE_PINS)
        (target / INSTALLED_MARK).touch()
    return target


def known_texts(tokenizer_file: Path) -> list[str]:
    """Training sentences with no unknown word, and all of them as one text (longer than document_length)."""
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    unknown = tokenizer.token_to_id("[UNK]")
    texts = [text for text in tiny_models.training_sentences() if unknown not in tokenizer.encode(text).ids][:12]
    return [*texts, " ".join(texts[:6])]


@dataclass(frozen=True)
class ExportedColbert:
    """The PyLate-made folder, its published model folder, the export's report, and PyLate's answers."""

    source: Path
    published: Path
    report: dict
    texts: list[str]
    pylate: dict[str, np.ndarray]


@pytest.fixture(scope="module")
def colbert(tmp_path_factory: pytest.TempPathFactory, pylate_path: Path) -> ExportedColbert:
    """A tiny ColBERT folder made and answered by PyLate, exported in fp32 (the gate's sentences: a few)."""
    folder = tmp_path_factory.mktemp("colbert")
    base = tiny_models.save_model("bert", folder / "base")
    texts = known_texts(base / "tokenizer.json")
    (folder / "texts.json").write_text(json.dumps(texts))
    script = folder / "pylate_answers.py"
    script.write_text(PYLATE_SCRIPT.format(width=WIDTH, query_length=QUERY_LENGTH, document_length=DOCUMENT_LENGTH))
    source, answers = folder / "model", folder / "pylate.npz"
    environment = os.environ | {"PYTHONPATH": str(pylate_path), "HF_HUB_OFFLINE": "1"}
    made = subprocess.run(
        [sys.executable, str(script), str(base), str(source), str(folder / "texts.json"), str(answers)],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
    )
    assert made.returncode == 0, made.stderr
    sentences = folder / "sentences.txt"
    sentences.write_text("\n".join(tiny_models.training_sentences()[:24]) + "\n")
    repository = folder / "repository"
    report = export_model(
        load_checkpoint(source, name="colbert"), repository, ExportOptions(variants=("fp32",), sentences=sentences)
    )
    with np.load(answers) as pylate:
        return ExportedColbert(source, repository / "colbert", report, texts, dict(pylate))


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
    rules = spec.multivector
    query = input_type == multivector.QUERY
    rows = TextTokenizer(spec.tokenizer_file, spec.max_sequence_length, spec.pad_token_id).encode_marked_rows(
        texts,
        multivector.row_length(spec, input_type),
        rules.query_prefix_id if query else rules.document_prefix_id,
        rules.query_expansion_id if query else None,
        rules.attend_to_expansion_tokens,
    )
    feed = rows.padded(spec.pad_token_id)
    (vectors,) = session.run(["token_vectors"], {name: feed[name] for name in spec.input_names})
    return multivector.row_vectors(vectors, multivector.kept_positions(rows, rules, input_type))


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
