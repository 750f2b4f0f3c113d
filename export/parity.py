"""The parity gate: every variant's ONNX Runtime outputs against the PyTorch model.

Cases are random token batches (sizes x lengths, with random padding) and real sentences
through the model's tokenizer. A variant whose figures miss its tolerances is refused, and the
failure names the worst case.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from export.model import Encoder
from service.tokenizer import TextTokenizer

BATCH_SIZES = (1, 2, 7, 32)
SENTENCE_BATCH = 16
SENTENCES_FILE = Path(__file__).resolve().parent / "data" / "sentences.txt"


@dataclass(frozen=True)
class Tolerance:
    """What a variant must meet; cosine is over pooled embeddings, diff over unpadded hidden states."""

    min_cosine: float
    max_abs_diff: float | None
    """None: the hidden states are reported, not gated."""
    gated_kinds: tuple[str, ...]
    """Case kinds ("tokens", "sentences") the tolerance applies to; others are reported only."""


TOLERANCES = {
    "fp32": Tolerance(min_cosine=0.99999, max_abs_diff=1e-4, gated_kinds=("tokens", "sentences")),
    "int8": Tolerance(min_cosine=0.99, max_abs_diff=None, gated_kinds=("sentences",)),
    "fp16": Tolerance(min_cosine=0.999, max_abs_diff=None, gated_kinds=("tokens", "sentences")),
}


@dataclass(frozen=True)
class Case:
    """One batch fed to both models; labels name each row for failure messages."""

    kind: str
    name: str
    feed: dict[str, np.ndarray]
    row_labels: tuple[str, ...]


@dataclass
class Reference:
    """A case with the PyTorch model's outputs."""

    case: Case
    hidden: np.ndarray
    embedding: np.ndarray


@dataclass
class KindFigures:
    """Worst and mean agreement over the cases of one kind."""

    min_cosine: float = 1.0
    cosines: list[float] = field(default_factory=list)
    worst_cosine_case: str = ""
    max_abs_diff: float = 0.0
    worst_diff_case: str = ""

    def to_dict(self) -> dict[str, object]:
        """Figures for parity.json."""
        return {
            "min_cosine": round(self.min_cosine, 8),
            "mean_cosine": round(float(np.mean(self.cosines)), 8),
            "worst_cosine_case": self.worst_cosine_case,
            "max_abs_diff_last_hidden_state": float(f"{self.max_abs_diff:.3g}"),
            "worst_diff_case": self.worst_diff_case,
            "rows": len(self.cosines),
        }


@dataclass
class GateResult:
    """A variant's figures and verdict."""

    variant: str
    provider: str
    figures: dict[str, KindFigures]
    failures: list[str]

    @property
    def passed(self) -> bool:
        """Whether every gated figure met its tolerance."""
        return not self.failures

    def to_dict(self) -> dict[str, object]:
        """Figures for parity.json."""
        tolerance = TOLERANCES[self.variant]
        return {
            "passed": self.passed,
            "provider": self.provider,
            "tolerance": {
                "min_cosine": tolerance.min_cosine,
                "max_abs_diff": tolerance.max_abs_diff,
                "gated_kinds": list(tolerance.gated_kinds),
            },
            "cases": {kind: figures.to_dict() for kind, figures in self.figures.items()},
            "failures": self.failures,
        }


def token_cases(input_names: list[str], vocab_size: int, max_length: int, seed: int = 0) -> list[Case]:
    """Random token batches of sizes {1, 2, 7, 32} and lengths {1, 5, 64, max}, randomly padded.

    The first row of each batch is full length so the padded width is exercised; the others
    get random lengths with padding after them.
    """
    rng = np.random.default_rng(seed)
    lengths = sorted({min(length, max_length) for length in (1, 5, 64, max_length)})
    cases = []
    for batch in BATCH_SIZES:
        for length in lengths:
            row_lengths = rng.integers(1, length + 1, size=batch)
            row_lengths[0] = length
            mask = (np.arange(length)[None, :] < row_lengths[:, None]).astype(np.int64)
            ids = rng.integers(1, vocab_size, size=(batch, length), dtype=np.int64) * mask
            feed = {
                "input_ids": ids,
                "attention_mask": mask,
                "token_type_ids": rng.integers(0, 2, size=(batch, length), dtype=np.int64) * mask,
            }
            name = f"tokens {batch}x{length}"
            labels = tuple(f"{name} row {row} (length {n})" for row, n in enumerate(row_lengths))
            cases.append(Case("tokens", name, feed, labels))
    return cases


def sentence_cases(input_names: list[str], tokenizer: TextTokenizer, sentences: list[str]) -> list[Case]:
    """Real sentences through the model's tokenizer, in batches padded to their longest."""
    cases = []
    for start in range(0, len(sentences), SENTENCE_BATCH):
        chunk = sentences[start : start + SENTENCE_BATCH]
        feed = tokenizer.encode(chunk).feed(input_names)
        labels = tuple(f"sentence {start + i + 1}: {text[:40]!r}" for i, text in enumerate(chunk))
        cases.append(
            Case("sentences", f"sentences {start + 1}-{start + len(chunk)}", {k: feed[k] for k in input_names}, labels)
        )
    return cases


def read_sentences(path: Path = SENTENCES_FILE) -> list[str]:
    """Non-empty lines of a sentence file."""
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@torch.inference_mode()
def reference_outputs(model: Encoder, cases: list[Case]) -> list[Reference]:
    """Run the PyTorch model (fp32) on every case."""
    references = []
    for case in cases:
        tensors = {name: torch.from_numpy(array) for name, array in case.feed.items()}
        hidden, embedding = model(**tensors)
        references.append(Reference(case, hidden.numpy(), embedding.numpy()))
    return references


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    norms = np.linalg.norm(a64, axis=1) * np.linalg.norm(b64, axis=1)
    return (a64 * b64).sum(axis=1) / np.maximum(norms, 1e-30)


def check_variant(variant: str, session: ort.InferenceSession, references: list[Reference]) -> GateResult:
    """Compare one ONNX Runtime session against the references and apply the variant's tolerance."""
    tolerance = TOLERANCES[variant]
    figures: dict[str, KindFigures] = {}
    for reference in references:
        case = reference.case
        hidden, embedding = session.run(["last_hidden_state", "embedding"], case.feed)
        kind = figures.setdefault(case.kind, KindFigures())
        cosines = _cosines(embedding, reference.embedding)
        kind.cosines.extend(cosines.tolist())
        worst_row = int(np.argmin(cosines))
        if cosines[worst_row] < kind.min_cosine:
            kind.min_cosine = float(cosines[worst_row])
            kind.worst_cosine_case = case.row_labels[worst_row]
        valid = case.feed["attention_mask"].astype(bool)
        diff = float(np.abs(hidden - reference.hidden)[valid].max())
        if diff > kind.max_abs_diff:
            kind.max_abs_diff = diff
            kind.worst_diff_case = case.name
    failures = []
    # A model without a tokenizer has no sentence cases: its token cases are gated instead.
    gated = [name for name in tolerance.gated_kinds if name in figures] or list(figures)
    for kind_name in gated:
        kind = figures[kind_name]
        if kind.min_cosine < tolerance.min_cosine:
            failures.append(
                f"{variant}: embedding cosine {kind.min_cosine:.6f} < {tolerance.min_cosine} "
                f"at {kind.worst_cosine_case}"
            )
        if tolerance.max_abs_diff is not None and kind.max_abs_diff > tolerance.max_abs_diff:
            failures.append(
                f"{variant}: last_hidden_state max |diff| {kind.max_abs_diff:.3g} > {tolerance.max_abs_diff} "
                f"at {kind.worst_diff_case}"
            )
    return GateResult(variant, session.get_providers()[0], figures, failures)
