"""Tiny multi-vector models exported once, shared by the export and serving tests: ColBERT and bge-m3.

bge-m3: a tiny random XLM-R folder saved as FlagEmbedding publishes bge-m3 (transformers weights,
colbert_linear.pt and sparse_linear.pt, sentence-transformers files with CLS pooling and Normalize).

ColBERT:

PyLate (the library that makes these folders) cannot run beside the project's sentence-transformers
6.2, so it is installed apart, with its own pins, into .test-cache/ (once per pin list and interpreter),
and runs in a subprocess: it makes the tiny ColBERT folder from a tiny BERT, and answers
`encode(is_query=True/False)` and `colbert_scores` for texts the tokenizer knows every word of, and
for texts with characters it lacks ([UNK] tokens: PyLate maps a skiplist word missing from the
vocabulary to [UNK], so it drops a document's [UNK] tokens, and the export follows it: export.heads.colbert).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import transformers
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer import modules as st_models
from tokenizers import Tokenizer

from export.build import ExportOptions, export_model
from export.checkpoints.checkpoint import load_checkpoint
from export.heads.bge_m3 import COLBERT_HEAD_FILE, SPARSE_HEAD_FILE
from tests.export import tiny_models
from tests.installs import pip_install
from tests.servers import ROOT

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


def pylate_path() -> Path:
    """A folder holding PyLate and its pins (pip --target), for PYTHONPATH; cached under .test-cache/."""
    key = hashlib.sha256("\n".join((*PYLATE_PINS, sys.executable)).encode()).hexdigest()[:16]
    target = ROOT / ".test-cache" / f"pylate-overlay-{key}"
    if not (target / INSTALLED_MARK).is_file():
        shutil.rmtree(target, ignore_errors=True)
        pip_install(Path(sys.executable), "--no-deps", "--target", str(target), *PYLATE_PINS)
        (target / INSTALLED_MARK).touch()
    return target


UNKNOWN_TEXTS = ("the ☃ snowman moved past 東京 ✓", "✓ ✓ and then the end ☃")
"""Texts with characters the tiny vocabulary lacks: [UNK] tokens among known ones."""


def colbert_texts(tokenizer_file: Path) -> list[str]:
    """Training sentences with no unknown word, UNKNOWN_TEXTS, and the first six known ones as one text (longer than
    document_length)."""
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    unknown = tokenizer.token_to_id("[UNK]")
    texts = [text for text in tiny_models.training_sentences() if unknown not in tokenizer.encode(text).ids][:12]
    return [*texts, *UNKNOWN_TEXTS, " ".join(texts[:6])]


MULTIVECTOR_MADE_BY = (Path(__file__), Path(tiny_models.__file__))
"""The helpers that make the multi-vector source folders (what their cached exports are keyed by, besides inputs)."""
TEXTS_FILE, PYLATE_ANSWERS = "texts.json", "pylate.npz"
PUBLISHED = "repository"


@dataclass(frozen=True)
class ExportedColbert:
    """The PyLate-made folder, its published model folder, and PyLate's answers."""

    source: Path
    published: Path
    texts: list[str]
    pylate: dict[str, np.ndarray]


def make_colbert(folder: Path, pylate_path: Path) -> None:
    """A tiny ColBERT folder made and answered by PyLate in `folder`, exported in fp32 (the gate's sentences: a few,
    and UNKNOWN_TEXTS)."""
    base = tiny_models.save_model("bert", folder / "base")
    texts = colbert_texts(base / "tokenizer.json")
    (folder / TEXTS_FILE).write_text(json.dumps(texts))
    script = folder / "pylate_answers.py"
    script.write_text(PYLATE_SCRIPT.format(width=WIDTH, query_length=QUERY_LENGTH, document_length=DOCUMENT_LENGTH))
    source, answers = folder / "model", folder / PYLATE_ANSWERS
    environment = os.environ | {"PYTHONPATH": str(pylate_path), "HF_HUB_OFFLINE": "1"}
    made = subprocess.run(
        [sys.executable, str(script), str(base), str(source), str(folder / TEXTS_FILE), str(answers)],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
    )
    assert made.returncode == 0, made.stderr
    sentences = folder / "sentences.txt"
    sentences.write_text("\n".join([*tiny_models.training_sentences()[:24], *UNKNOWN_TEXTS]) + "\n")
    options = ExportOptions(variants=("fp32",), sentences=sentences)
    export_model(load_checkpoint(source, name="colbert"), folder / PUBLISHED, options)


def read_colbert(folder: Path) -> ExportedColbert:
    """What make_colbert left in `folder`."""
    with np.load(folder / PYLATE_ANSWERS) as pylate:
        texts = json.loads((folder / TEXTS_FILE).read_text())
        return ExportedColbert(folder / "model", folder / PUBLISHED / "colbert", texts, dict(pylate))


BGE_M3_TEXTS = [*tiny_models.training_sentences()[:10], "ok", " ".join(tiny_models.training_sentences()[10:30])]
"""Gate-like texts, a very short one, and one longer than the model's window (truncated on both sides)."""
BGE_M3_WIDTH = 24
"""Narrower than the hidden size (32): the token vectors' width is the head's, not the encoder's."""


def save_bge_m3(folder: Path, seed: int = 0) -> Path:
    """A tiny bge-m3 folder as FlagEmbedding publishes one: an XLM-R sentence-transformers model and the two heads."""
    base = tiny_models.save_model("xlm-roberta", folder / "base", seed=seed)
    transformer = st_models.Transformer(str(base), max_seq_length=tiny_models.MAX_POSITIONS - 2)
    pooling = st_models.Pooling(transformer.get_embedding_dimension(), pooling_mode="cls")
    target = folder / "model"
    SentenceTransformer(modules=[transformer, pooling, st_models.Normalize()]).save(str(target))
    generator = torch.Generator().manual_seed(seed)
    hidden = tiny_models.HIDDEN
    colbert = {
        "weight": torch.randn(BGE_M3_WIDTH, hidden, generator=generator) * 0.2,
        "bias": torch.randn(BGE_M3_WIDTH, generator=generator) * 0.1,
    }
    # The bias centres the sparse head on the model's hidden states: about half the positions weigh 0 (relu).
    weight = torch.randn(1, hidden, generator=generator) * 0.3
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(base))
    batch = tokenizer(tiny_models.training_sentences(), padding=True, truncation=True, return_tensors="pt")
    with torch.inference_mode():
        states = transformers.AutoModel.from_pretrained(str(base)).eval()(**batch).last_hidden_state
    sparse = {"weight": weight, "bias": -(states[batch["attention_mask"].bool()] @ weight.T).median().reshape(1)}
    torch.save(colbert, target / COLBERT_HEAD_FILE)
    torch.save(sparse, target / SPARSE_HEAD_FILE)
    return target


class _Warnings(logging.Handler):
    """The export's warnings, kept."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@dataclass(frozen=True)
class ExportedBgeM3:
    """The tiny source folder, its published model folder, and the export's warnings."""

    source: Path
    published: Path
    warnings: list[str]


WARNINGS_FILE = "export-warnings.json"


def make_bge_m3(folder: Path) -> None:
    """The tiny bge-m3 folder exported in `folder` (every variant asked for: fp32 alone is published), with the
    export's warnings."""
    source = save_bge_m3(folder / "source")
    warnings = _Warnings()
    logger = logging.getLogger("export")
    logger.addHandler(warnings)
    try:
        export_model(load_checkpoint(source, name="bge-m3"), folder / PUBLISHED, ExportOptions())
    finally:
        logger.removeHandler(warnings)
    (folder / WARNINGS_FILE).write_text(json.dumps(warnings.messages))


def read_bge_m3(folder: Path) -> ExportedBgeM3:
    """What make_bge_m3 left in `folder`."""
    warnings = json.loads((folder / WARNINGS_FILE).read_text())
    return ExportedBgeM3(folder / "source" / "model", folder / PUBLISHED / "bge-m3", warnings)
