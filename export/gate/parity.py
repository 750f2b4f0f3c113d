"""The parity gate: every variant's ONNX Runtime outputs against the PyTorch model, on export.gate.cases.

A variant whose figures miss its tolerances is refused, and the failure names the worst case. Outputs
per position besides the hidden states (bge-m3's token_vectors and token_weights) are held, at
attended positions, to the hidden states' largest difference, and token vectors to the embedding's
cosine. What a user of the server gets is measured apart (export.gate.served).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

from export.gate.cases import Case
from service.core.fidelity import (
    LOGITS_MAX_ABS_DIFF,
    VARIANT_MIN_COSINE,
    cosines,
)
from service.core.repository import TOKEN_VECTORS


class GateRefused(RuntimeError):
    """fp32 or int8 failed the parity gate, or a reference library disagreed; nothing was published."""


@dataclass(frozen=True)
class Tolerance:
    """What a variant must meet; cosine is over pooled embeddings, diff over unpadded hidden states."""

    min_cosine: float
    max_abs_diff: float | None
    """None: the hidden states are reported, not gated."""
    max_logits_diff: float | None
    """A classifier's largest logit difference (it has no hidden states); None: not gated, not published."""
    gated_kinds: tuple[str, ...]
    """Case kinds ("tokens", "sentences") the tolerance applies to; others are reported only."""


TOLERANCES = {
    "fp32": Tolerance(
        min_cosine=VARIANT_MIN_COSINE["fp32"],
        max_abs_diff=1e-4,
        max_logits_diff=1e-4,
        gated_kinds=("tokens", "sentences", "sentence_masks"),
    ),
    # Random token ids are not int8's domain: they are reported for it, not gated.
    "int8": Tolerance(
        min_cosine=VARIANT_MIN_COSINE["int8"],
        max_abs_diff=None,
        max_logits_diff=None,
        gated_kinds=("sentences", "sentence_masks"),
    ),
    "fp16": Tolerance(
        min_cosine=VARIANT_MIN_COSINE["fp16"],
        max_abs_diff=None,
        max_logits_diff=LOGITS_MAX_ABS_DIFF["fp16"],
        gated_kinds=("tokens", "sentences", "sentence_masks"),
    ),
}


@dataclass
class Reference:
    """A case with the PyTorch model's outputs."""

    case: Case
    hidden: np.ndarray | None
    """last_hidden_state; None for a classifier, a sparse embedder or a ColBERT model (one output only)."""
    output: np.ndarray
    """What the model answers per row: its embedding, a classifier's logits, a sparse embedding, or a ColBERT
    model's token vectors [rows, sequence, width]."""
    output_name: str = "embedding"
    """The graph output `output` is of: embedding, logits, sparse_embedding or token_vectors."""
    extras: dict[str, np.ndarray] = field(default_factory=dict)
    """Outputs per position besides the embedding (bge-m3's token_vectors and token_weights), by name."""


@dataclass
class OutputFigures:
    """One per-position output's agreement (token_vectors, token_weights) over the cases of one kind.

    Only attended positions count: the server reads no other.
    """

    max_abs_diff: float = 0.0
    worst_diff_case: str = ""
    min_cosine: float | None = None
    """Each attended position's vector's cosine (token_vectors); None: a weight per position, no cosine."""
    worst_cosine_case: str = ""

    def to_dict(self) -> dict[str, object]:
        """Figures for parity.json."""
        figures: dict[str, object] = {
            "max_abs_diff": float(f"{self.max_abs_diff:.3g}"),
            "worst_diff_case": self.worst_diff_case,
        }
        if self.min_cosine is not None:
            figures |= {"min_cosine": round(self.min_cosine, 8), "worst_cosine_case": self.worst_cosine_case}
        return figures


@dataclass
class KindFigures:
    """Worst and mean agreement over the cases of one kind."""

    min_cosine: float = 1.0
    cosines: list[float] = field(default_factory=list)
    worst_cosine_case: str = ""
    max_abs_diff: float = 0.0
    worst_diff_case: str = ""
    compared: str = "last_hidden_state"
    """The output max_abs_diff is over: last_hidden_state, a classifier's logits (which have no cosine),
    sparse_embedding_relative_to_row_max (each row's largest difference over that row's largest value), or
    token_vectors_attended (a ColBERT model's vectors at attended positions; the cosine is per position)."""
    rows: int = 0
    outputs: dict[str, OutputFigures] = field(default_factory=dict)
    """Per-position outputs besides the embedding (bge-m3's), at attended positions."""

    def to_dict(self) -> dict[str, object]:
        """Figures for parity.json."""
        figures: dict[str, object] = {}
        if self.cosines:
            figures = {
                "min_cosine": round(self.min_cosine, 8),
                "mean_cosine": round(float(np.mean(self.cosines)), 8),
                "worst_cosine_case": self.worst_cosine_case,
            }
        return (
            figures
            | {
                f"max_abs_diff_{self.compared}": float(f"{self.max_abs_diff:.3g}"),
                "worst_diff_case": self.worst_diff_case,
                "rows": self.rows,
            }
            | {name: output.to_dict() for name, output in self.outputs.items()}
        )


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
                "max_logits_diff": tolerance.max_logits_diff,
                "gated_kinds": list(tolerance.gated_kinds),
            },
            "cases": {kind: figures.to_dict() for kind, figures in self.figures.items()},
            "failures": self.failures,
        }


@torch.inference_mode()
def reference_outputs(model: nn.Module, cases: list[Case]) -> list[Reference]:
    """Run the PyTorch model (fp32) on every case."""
    references = []
    for case in cases:
        tensors = {name: torch.from_numpy(array) for name, array in case.feed.items()}
        answer = model(**tensors)
        if isinstance(answer, tuple):
            hidden, embedding, *extras = (output.numpy() for output in answer)
            named = dict(zip(model.output_names[2:], extras, strict=True))
            references.append(Reference(case, hidden, embedding, extras=named))
        else:
            references.append(Reference(case, None, answer.numpy(), model.output_names[-1]))
    return references


def _compare_logits(kind: KindFigures, case: Case, logits: np.ndarray, reference: np.ndarray) -> None:
    """A classifier's figures: the largest logit difference (logits have no meaningful cosine)."""
    kind.compared = "logits"
    diff = np.abs(logits - reference).max(axis=1)
    worst = int(np.argmax(diff))
    if diff[worst] > kind.max_abs_diff:
        kind.max_abs_diff = float(diff[worst])
        kind.worst_diff_case = case.row_labels[worst]


def _record_cosines(kind: KindFigures, case: Case, answer: np.ndarray, reference: np.ndarray) -> None:
    """Each row's cosine to the reference, and the worst so far."""
    row_cosines = cosines(answer, reference)
    kind.cosines.extend(row_cosines.tolist())
    worst_row = int(np.argmin(row_cosines))
    if row_cosines[worst_row] < kind.min_cosine:
        kind.min_cosine = float(row_cosines[worst_row])
        kind.worst_cosine_case = case.row_labels[worst_row]


def _compare_sparse(kind: KindFigures, case: Case, answer: np.ndarray, reference: np.ndarray) -> None:
    """A sparse embedding's figures: cosine, and each row's largest difference relative to its largest value.

    Relative, because a SPLADE row's scale is the model's (log-saturated term weights, often several
    units): an absolute bound would be looser or stricter from one model to the next.
    """
    kind.compared = "sparse_embedding_relative_to_row_max"
    _record_cosines(kind, case, answer, reference)
    diff = np.abs(answer - reference).max(axis=1) / np.maximum(np.abs(reference).max(axis=1), 1e-30)
    worst = int(np.argmax(diff))
    if diff[worst] > kind.max_abs_diff:
        kind.max_abs_diff = float(diff[worst])
        kind.worst_diff_case = case.row_labels[worst]


def _compare_token_vectors(kind: KindFigures, case: Case, answer: np.ndarray, reference: np.ndarray) -> None:
    """A ColBERT model's figures over attended positions: each position's cosine, the largest difference.

    A row's cosine is its worst position's. Unattended positions (padding, holes) are left out here:
    a query's expansion tokens are compared through the served path (export.gate.references.library).
    """
    kind.compared = "token_vectors_attended"
    valid = case.feed["attention_mask"].astype(bool)
    row_cosines = np.array(
        [cosines(answer[row][valid[row]], reference[row][valid[row]]).min() for row in range(len(valid))]
    )
    kind.cosines.extend(row_cosines.tolist())
    worst_row = int(np.argmin(row_cosines))
    if row_cosines[worst_row] < kind.min_cosine:
        kind.min_cosine = float(row_cosines[worst_row])
        kind.worst_cosine_case = case.row_labels[worst_row]
    diff = np.array([np.abs(answer[row][valid[row]] - reference[row][valid[row]]).max() for row in range(len(valid))])
    worst = int(np.argmax(diff))
    if diff[worst] > kind.max_abs_diff:
        kind.max_abs_diff = float(diff[worst])
        kind.worst_diff_case = case.row_labels[worst]


_SINGLE_OUTPUT_COMPARISONS = {
    "logits": _compare_logits,
    "sparse_embedding": _compare_sparse,
    "token_vectors": _compare_token_vectors,
}
"""How a one-output model's answers are compared, by output."""


def _compare_positions(
    figures: OutputFigures, case: Case, answer: np.ndarray, expected: np.ndarray, valid: np.ndarray
) -> None:
    """A per-position output ([batch, seq] or [batch, seq, width]) at the attended positions (valid [batch, seq])."""
    difference = np.abs(answer - expected)
    if difference.ndim == 3:
        difference = difference.max(axis=2)
    per_row = np.where(valid, difference, 0.0).max(axis=1)
    worst = int(np.argmax(per_row))
    if per_row[worst] > figures.max_abs_diff:
        figures.max_abs_diff = float(per_row[worst])
        figures.worst_diff_case = case.row_labels[worst]
    if figures.min_cosine is not None:
        position_cosines = cosines(answer[valid], expected[valid])
        rows = np.nonzero(valid)[0]
        at = int(np.argmin(position_cosines))
        if position_cosines[at] < figures.min_cosine:
            figures.min_cosine = float(position_cosines[at])
            figures.worst_cosine_case = case.row_labels[rows[at]]


def _position_failures(variant: str, tolerance: Tolerance, outputs: dict[str, OutputFigures]) -> list[str]:
    """The per-position outputs' misses: each value within max_abs_diff, each vector's cosine >= min_cosine."""
    failures = []
    for name, figures in outputs.items():
        if tolerance.max_abs_diff is not None and figures.max_abs_diff > tolerance.max_abs_diff:
            failures.append(
                f"{variant}: {name} max |diff| {figures.max_abs_diff:.3g} > {tolerance.max_abs_diff}"
                f" at {figures.worst_diff_case}"
            )
        if figures.min_cosine is not None and figures.min_cosine < tolerance.min_cosine:
            failures.append(
                f"{variant}: {name} cosine {figures.min_cosine:.6f} < {tolerance.min_cosine}"
                f" at {figures.worst_cosine_case}"
            )
    return failures


def check_variant(variant: str, session: ort.InferenceSession, references: list[Reference]) -> GateResult:
    """Compare one ONNX Runtime session against the references and apply the variant's tolerance."""
    tolerance = TOLERANCES[variant]
    figures: dict[str, KindFigures] = {}
    for reference in references:
        case = reference.case
        kind = figures.setdefault(case.kind, KindFigures())
        kind.rows += len(case.row_labels)
        if reference.hidden is None:
            compare = _SINGLE_OUTPUT_COMPARISONS[reference.output_name]
            compare(kind, case, session.run([reference.output_name], case.feed)[0], reference.output)
            continue
        hidden, embedding, *extras = session.run(["last_hidden_state", "embedding", *reference.extras], case.feed)
        _record_cosines(kind, case, embedding, reference.output)
        valid = case.feed["attention_mask"].astype(bool)
        diff = float(np.abs(hidden - reference.hidden)[valid].max())
        if diff > kind.max_abs_diff:
            kind.max_abs_diff = diff
            kind.worst_diff_case = case.name
        for (name, expected), answer in zip(reference.extras.items(), extras, strict=True):
            figures_of = kind.outputs.setdefault(name, OutputFigures(min_cosine=1.0 if name == TOKEN_VECTORS else None))
            _compare_positions(figures_of, case, answer, expected, valid)
    failures = []
    # A model without a tokenizer has no sentence cases: its token cases are gated instead.
    gated = [name for name in tolerance.gated_kinds if name in figures] or list(figures)
    for kind_name in gated:
        kind = figures[kind_name]
        if kind.min_cosine < tolerance.min_cosine:
            output = next((name for name in _SINGLE_OUTPUT_COMPARISONS if kind.compared.startswith(name)), "embedding")
            failures.append(
                f"{variant}: {output} cosine {kind.min_cosine:.6f} < {tolerance.min_cosine} at {kind.worst_cosine_case}"
            )
        bound = tolerance.max_logits_diff if kind.compared == "logits" else tolerance.max_abs_diff
        if bound is not None and kind.max_abs_diff > bound:
            failures.append(
                f"{variant}: {kind.compared} max |diff| {kind.max_abs_diff:.3g} > {bound} at {kind.worst_diff_case}"
            )
        failures += _position_failures(variant, tolerance, kind.outputs)
    return GateResult(variant, session.get_providers()[0], figures, failures)
