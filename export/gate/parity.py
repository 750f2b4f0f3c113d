"""The parity gate: every variant's ONNX Runtime outputs against the PyTorch model.

Cases are random token batches (sizes x lengths; each padded row right-padded, left-padded or
with holes in its mask, in turn), real sentences through the model's tokenizer, and the same
sentences left-padded and with a hole in the middle of each mask (kind "sentence_masks"): the
codec accepts any 0/1 mask, so every graph must honour any of them. A variant whose figures
miss its tolerances is refused, and the failure names the worst case. Outputs per position besides
the hidden states (bge-m3's token_vectors and token_weights) are held, at attended positions, to the
hidden states' largest difference, and token vectors to the embedding's cosine.

Separately, `served_fidelity` measures what a user of the server gets: each sentence through the
server's tokenizer configuration, alone and in padded batches, `embedding` out, against the model
run on that sentence alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

from service.core.fidelity import (
    FIDELITY_MIN_COSINE,
    LOGITS_MAX_ABS_DIFF,
    VARIANT_MIN_COSINE,
    FidelityReference,
    cosines,
)
from service.core.repository import ADAPTER_IDS, TASK_VECTORS, TOKEN_VECTORS
from service.pipeline.tokenizer import TextTokenizer

BATCH_SIZES = (1, 2, 7, 32)
SENTENCE_BATCH = 16
SENTENCES_FILE = Path(__file__).resolve().parents[1] / "data" / "sentences.txt"
MASK_STYLES = ("right-padded", "left-padded", "holed")
HOLE_TOKENS = 2
"""Positions masked out in the middle of each sentence for the holed cases."""
SERVED_LENGTH_BUCKET = 32
"""Served batches are padded to a multiple of this (the server's CUDA length bucket)."""
FIDELITY_ROWS = 6
"""Gate sentences stored for the server's check at load (plus one left-padded and one holed copy)."""
FIDELITY_MAX_TOKENS = 48
"""Longest sentence stored for the check at load: it runs at every load, on the CPU too (tens of ms)."""


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


def mask_row(length: int, real: int, style: str, rng: np.random.Generator) -> np.ndarray:
    """A 0/1 mask of `length` with `real` ones: at the start, at the end, or scattered (first kept)."""
    row = np.zeros(length, dtype=np.int64)
    if style == "right-padded":
        row[:real] = 1
    elif style == "left-padded":
        row[length - real :] = 1
    else:
        row[0] = 1
        row[1 + rng.choice(length - 1, size=real - 1, replace=False)] = 1
    return row


GATE_ADAPTER_IDS = 6
"""Adapter ids the gate's rows cycle through on a model with task adapters: none, then jina-embeddings-v3's five
(an id past a model's tasks selects none, as 0 does)."""
CASE_TOKENS = 8192
"""The most tokens one random-token gate batch holds (32 rows of 256; one row of 8,192)."""


def token_cases(input_names: list[str], vocab_size: int, max_length: int, seed: int = 0) -> list[Case]:
    """Random token batches of sizes {1, 2, 7, 32} and lengths {1, 5, 64, max}, with every mask shape.

    The first row of each batch is full length so the padded width is exercised; the others get
    random lengths, padded on the right, on the left or with holes in the mask, in turn. A batch
    holds at most CASE_TOKENS tokens (fewer rows at long lengths): attention's scores grow with the
    square of the length, and 32 rows of 8,192 tokens would take about 100 GB.
    """
    rng = np.random.default_rng(seed)
    lengths = sorted({min(length, max_length) for length in (1, 5, 64, max_length)})
    cases = []
    seen = set()
    for size in BATCH_SIZES:
        for length in lengths:
            batch = max(1, min(size, CASE_TOKENS // length))
            if (batch, length) in seen:
                continue
            seen.add((batch, length))
            row_lengths = rng.integers(1, length + 1, size=batch)
            row_lengths[0] = length
            styles = ["full"] + [MASK_STYLES[row % len(MASK_STYLES)] for row in range(batch - 1)]
            mask = np.stack([mask_row(length, n, style, rng) for n, style in zip(row_lengths, styles, strict=True)])
            ids = rng.integers(1, vocab_size, size=(batch, length), dtype=np.int64) * mask
            feed = {
                "input_ids": ids,
                "attention_mask": mask,
                "token_type_ids": rng.integers(0, 2, size=(batch, length), dtype=np.int64) * mask,
            }
            feed = with_adapter_ids(feed, input_names, first=len(cases))
            name = f"tokens {batch}x{length}"
            labels = tuple(
                f"{name} row {row} ({style}, {n} tokens)"
                for row, (n, style) in enumerate(zip(row_lengths, styles, strict=True))
            )
            cases.append(Case("tokens", name, {k: feed[k] for k in input_names}, labels))
    return cases


def with_adapter_ids(feed: dict[str, np.ndarray], input_names: list[str], first: int = 0) -> dict[str, np.ndarray]:
    """The feed with adapter_ids where the graph takes them: each task's adapter (and none) on some of its rows.

    Row i's every token takes id (first + i) mod GATE_ADAPTER_IDS.
    """
    if ADAPTER_IDS not in input_names:
        return feed
    rows, length = feed["input_ids"].shape
    ids = (first + np.arange(rows, dtype=np.int64)) % GATE_ADAPTER_IDS
    return feed | {ADAPTER_IDS: np.repeat(ids[:, None], length, axis=1)}


def sentence_pairs(sentences: list[str]) -> list[tuple[str, str]]:
    """Each sentence with the next one (the last with the first): a classifier's gate inputs."""
    return [(text, sentences[(i + 1) % len(sentences)]) for i, text in enumerate(sentences)]


def _encode(tokenizer: TextTokenizer, chunk: list) -> dict[str, np.ndarray]:
    """A padded batch of texts, or of pairs as the model's tokenizer pairs them."""
    batch = tokenizer.encode_pairs(chunk) if isinstance(chunk[0], tuple) else tokenizer.encode(chunk)
    return batch.feed(("input_ids", "attention_mask", "token_type_ids", ADAPTER_IDS))


def _label(item: str | tuple[str, str]) -> str:
    return repr(item[0][:40]) if isinstance(item, tuple) else repr(item[:40])


def sentence_cases(input_names: list[str], tokenizer: TextTokenizer, sentences: list) -> list[Case]:
    """Real sentences (or pairs of them) through the model's tokenizer, in batches padded to their longest."""
    cases = []
    for start in range(0, len(sentences), SENTENCE_BATCH):
        chunk = sentences[start : start + SENTENCE_BATCH]
        feed = with_adapter_ids(_encode(tokenizer, chunk), input_names, first=start)
        labels = tuple(f"sentence {start + i + 1}: {_label(text)}" for i, text in enumerate(chunk))
        cases.append(
            Case("sentences", f"sentences {start + 1}-{start + len(chunk)}", {k: feed[k] for k in input_names}, labels)
        )
    return cases


def left_padded(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A right-padded batch with each row's tokens moved to the end (padding first)."""
    length = feed["input_ids"].shape[1]
    moved = {name: np.zeros_like(array) for name, array in feed.items()}
    for row, real in enumerate(feed["attention_mask"].sum(axis=1)):
        for name, array in feed.items():
            moved[name][row, length - real :] = array[row, :real]
    return moved


def holed(feed: dict[str, np.ndarray], hole: int = HOLE_TOKENS) -> dict[str, np.ndarray]:
    """A right-padded batch with up to `hole` positions masked out in the middle of each row (ids kept).

    Rows keep their width (a row at the model's maximum length stays valid); the masked tokens
    keep their ids, so a graph that let them leak into the result would show it.
    """
    spread = {name: array.copy() for name, array in feed.items()}
    for row, real in enumerate(feed["attention_mask"].sum(axis=1)):
        middle = max(1, int(real) // 2)
        spread["attention_mask"][row, middle : min(middle + hole, int(real) - 1)] = 0
    return spread


def sentence_mask_cases(input_names: list[str], tokenizer: TextTokenizer, sentences: list) -> list[Case]:
    """The sentence batches again, left-padded and with a hole in each row's mask (rows of 3+ tokens)."""
    cases = []
    for start in range(0, len(sentences), SENTENCE_BATCH):
        chunk = sentences[start : start + SENTENCE_BATCH]
        feed = with_adapter_ids(_encode(tokenizer, chunk), input_names, first=start)
        feed = {name: array for name, array in feed.items() if name in input_names}
        for style, reshaped in (("left-padded", left_padded(feed)), ("holed", holed(feed))):
            labels = tuple(f"sentence {start + i + 1} {style}: {_label(text)}" for i, text in enumerate(chunk))
            name = f"sentences {start + 1}-{start + len(chunk)} {style}"
            cases.append(Case("sentence_masks", name, reshaped, labels))
    return cases


def read_sentences(path: Path = SENTENCES_FILE) -> list[str]:
    """Non-empty lines of a sentence file."""
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


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


def pad_to(feed: dict[str, np.ndarray], length: int, pad_token_id: int = 0) -> dict[str, np.ndarray]:
    """A batch padded on the right to `length` (masked positions), as the server's batcher pads."""
    rows, width = feed["input_ids"].shape
    padded = {}
    for name, array in feed.items():
        fill = pad_token_id if name == "input_ids" else 0
        padded[name] = np.concatenate([array, np.full((rows, length - width), fill, dtype=array.dtype)], axis=1)
    return padded


@torch.inference_mode()
def embed_each(model: nn.Module, feeds: list[dict[str, np.ndarray]]) -> np.ndarray:
    """The PyTorch model's answer for each feed (its embedding, or a classifier's logits), concatenated."""
    answers = []
    for feed in feeds:
        answer = model(**{name: torch.from_numpy(array) for name, array in feed.items()})
        answers.append((answer[1] if isinstance(answer, tuple) else answer).numpy())
    return np.concatenate(answers)


def served_feeds(
    tokenizer: TextTokenizer,
    items: list,
    input_names: list[str],
    *,
    max_length: int,
    pad_token_id: int,
    adapter_ids: list[int] | None = None,
) -> tuple[list[dict[str, np.ndarray]], list[dict[str, np.ndarray]]]:
    """Texts (or pairs) as the server feeds them: each alone, and in padded batches.

    Batches hold SENTENCE_BATCH rows padded on the right to a multiple of SERVED_LENGTH_BUCKET
    (never past max_length), as the server's batcher pads them. adapter_ids: each item's task
    adapter, every token of its row alike, as the server gives them (None: none).
    """

    def encoded_from(first: int, chunk: list) -> dict[str, np.ndarray]:
        feed = _encode(tokenizer, chunk)
        if adapter_ids is not None:
            ids = np.array(adapter_ids[first : first + len(chunk)], dtype=np.int64)
            feed[ADAPTER_IDS] = np.repeat(ids[:, None], feed["input_ids"].shape[1], axis=1)
        return feed

    alone = [{name: encoded_from(i, [item])[name] for name in input_names} for i, item in enumerate(items)]
    batches = []
    for start in range(0, len(items), SENTENCE_BATCH):
        encoded = encoded_from(start, items[start : start + SENTENCE_BATCH])
        feed = {name: encoded[name] for name in input_names}
        width = feed["input_ids"].shape[1]
        bucketed = -(-width // SERVED_LENGTH_BUCKET) * SERVED_LENGTH_BUCKET
        batches.append(pad_to(feed, max(width, min(bucketed, max_length)), pad_token_id))
    return alone, batches


@dataclass(frozen=True)
class ServedFigures:
    """What a user of the server gets from one variant: texts in, `embedding` out, against the model."""

    provider: str
    min_cosine: float
    mean_cosine: float
    worst_sentence: str
    sentences: int

    def to_dict(self) -> dict[str, object]:
        """Figures for parity.json."""
        return {
            "provider": self.provider,
            "min_cosine": round(self.min_cosine, 8),
            "mean_cosine": round(self.mean_cosine, 8),
            "worst_sentence": self.worst_sentence,
            "sentences": self.sentences,
            "fidelity_rule": FIDELITY_MIN_COSINE,
            "meets_fidelity_rule": self.min_cosine >= FIDELITY_MIN_COSINE,
            "path": "server tokenizer configuration; each sentence alone and in batches of "
            f"{SENTENCE_BATCH} padded to a multiple of {SERVED_LENGTH_BUCKET}; embedding output",
        }


class ServedPath:
    """The gate sentences as the server would see them, and the model's embedding of each one.

    expected: the PyTorch model's embeddings of the sentences in order (the "sentences" cases'
    references: right-padded batches, where the mask makes padding exactly inert).
    """

    def __init__(
        self,
        expected: np.ndarray,
        input_names: list[str],
        tokenizer: TextTokenizer,
        sentences: list[str],
        *,
        max_length: int,
        pad_token_id: int,
    ) -> None:
        self.sentences = sentences
        self.expected = expected
        self.alone, self.batches = served_feeds(
            tokenizer,
            sentences,
            input_names,
            max_length=max_length,
            pad_token_id=pad_token_id,
            adapter_ids=[i % GATE_ADAPTER_IDS for i in range(len(sentences))],  # as the sentence cases have them
        )

    def measure(self, session: ort.InferenceSession) -> ServedFigures:
        """Run every sentence through a session both ways; the worst of the two counts for each sentence."""
        alone = np.concatenate([session.run(["embedding"], feed)[0] for feed in self.alone])
        batched = np.concatenate([session.run(["embedding"], feed)[0] for feed in self.batches])
        row_cosines = np.minimum(cosines(alone, self.expected), cosines(batched, self.expected))
        worst = int(np.argmin(row_cosines))
        return ServedFigures(
            provider=session.get_providers()[0],
            min_cosine=float(row_cosines[worst]),
            mean_cosine=float(row_cosines.mean()),
            worst_sentence=f"sentence {worst + 1}: {self.sentences[worst][:40]!r}",
            sentences=len(self.sentences),
        )


def fidelity_reference(
    model: nn.Module, input_names: list[str], tokenizer: TextTokenizer | None, sentences: list, max_length: int
) -> FidelityReference:
    """The few inputs the server checks each variant with at load, and the model's fp32 embeddings for them.

    With a tokenizer: gate sentences of up to FIDELITY_MAX_TOKENS tokens spread from the shortest
    to the longest (short inputs are where lower precisions are weakest), then a middle one again
    left-padded and the longest with a hole in its mask. Without one: random token rows with each
    mask shape.
    """
    if tokenizer is not None:
        lengths = {text: _encode(tokenizer, [text])["input_ids"].shape[1] for text in sentences}
        short = [text for text in sentences if lengths[text] <= FIDELITY_MAX_TOKENS] or sentences
        by_length = sorted(short, key=lambda text: (lengths[text], text))
        step = (len(by_length) - 1) / max(1, FIDELITY_ROWS - 1)
        picks = list(dict.fromkeys(by_length[round(i * step)] for i in range(FIDELITY_ROWS)))
        feed = {name: array for name, array in _encode(tokenizer, picks).items() if name in input_names}
        middle, last = len(picks) // 2, len(picks) - 1
        extra = [
            ({k: v[middle : middle + 1] for k, v in left_padded(feed).items()}, f"{_label(picks[middle])} left-padded"),
            ({k: v[last:] for k, v in holed(feed).items()}, f"{_label(picks[last])} holed"),
        ]
        rows = [({k: v[i : i + 1] for k, v in feed.items()}, _label(text)) for i, text in enumerate(picks)]
        rows += extra
    else:
        rng = np.random.default_rng(0)
        length = min(16, max_length)
        rows = []
        for index, style in enumerate(("full", *MASK_STYLES, *MASK_STYLES)):
            real = length if style == "full" else int(rng.integers(1, length))
            mask = mask_row(length, real, style, rng)
            row = {
                "input_ids": rng.integers(1, model.config.vocab_size, size=(1, length), dtype=np.int64) * mask,
                "attention_mask": mask[None, :],
                "token_type_ids": np.zeros((1, length), dtype=np.int64),
            }
            label = f"tokens row {index} ({style}, {real} tokens)"
            rows.append(({name: row[name] for name in input_names if name != ADAPTER_IDS}, label))
    width = max(feed["input_ids"].shape[1] for feed, _ in rows)
    padded = [pad_to(feed, width, model.config.pad_token_id) for feed, _ in rows]
    batch = {name: np.concatenate([feed[name] for feed in padded]) for name in input_names if name != ADAPTER_IDS}
    batch = with_adapter_ids(batch, input_names)
    output = model.output_names[-1]  # embedding, logits, sparse_embedding or token_vectors

    output = next(name for name in model.output_names if name in TASK_VECTORS.values())  # embedding, logits, sparse
    return FidelityReference(batch, tuple(label for _, label in rows), embed_each(model, [batch]), output)
