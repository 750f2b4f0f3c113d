"""bge-m3's reference: FlagEmbedding's BGEM3FlagModel on the source folder, against every published variant.

The library that made the folder answers the gate texts (the gate sentences, and all of them as
one text, so that truncation is compared too) with its dense embeddings, lexical weights and
ColBERT vectors (`encode(..., return_dense=True, return_sparse=True, return_colbert_vecs=True)`, at
the model's max sequence length), and scores a few query/passage pairs (`colbert_score`). Each
published variant, fed as the server feeds it (the published tokenizer.json through `tokenizers`,
each text alone and in padded batches: the worse counts), must give the same answers read as the
server reads them: the embedding; each id's largest token weight; the token vectors of the attended
positions after the first; MaxSim averaged over the query's vectors. Term weights are compared over
both sides' ids, an id one side lacks weighing 0 there: an id on one side only passes only if its
weight is within the tolerance of 0 (a weight at the edge of relu), and such ids are counted.

FlagEmbedding is imported here only, when an export runs: the server never loads it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from export.gate.references.library import LIBRARY_BATCH_SIZE, LONG_TEXT_LABEL
from export.gate.references.loop import VariantCheck, VariantSession, unchecked
from export.gate.served import served_feeds
from service.core.fidelity import FIDELITY_MIN_COSINE, cosines
from service.core.repository import TOKEN_VECTORS, TOKEN_WEIGHTS
from service.pipeline.tokenizer import TextTokenizer

if TYPE_CHECKING:  # the heads list these checks, and the checkpoint lists the heads
    from export.checkpoints.checkpoint import Checkpoint

MIN_COSINE = FIDELITY_MIN_COSINE
"""The dense embedding's least cosine to FlagEmbedding's."""
MAX_ABS_DIFF = 1e-4
"""The largest difference from FlagEmbedding allowed in any value: embedding, term weight, token vector, score."""
SCORED_PAIRS = 4
"""Query/passage pairs of gate sentences scored with colbert_score (plus the first sentence against the long text)."""
M3_MODULE = "FlagEmbedding.inference.embedder.encoder_only.m3"
"""Where BGEM3FlagModel is defined (FlagEmbedding exports it under that name; the class is M3Embedder)."""
PARENT_PACKAGES = (
    "FlagEmbedding",
    "FlagEmbedding.inference",
    "FlagEmbedding.inference.embedder",
    "FlagEmbedding.inference.embedder.encoder_only",
)


def bge_m3_flag_model() -> type:
    """FlagEmbedding's BGEM3FlagModel, imported without running its parent packages' __init__ files.

    FlagEmbedding 1.4.2's `__init__` imports every model it has, its LLM rerankers among them, and
    those import `transformers.modeling_attn_mask_utils`, which transformers 5 removed: `import
    FlagEmbedding` fails. The M3 embedder's own modules do not need them and import fine, so its
    parent packages are registered with their path only; the code that answers is FlagEmbedding's.
    """
    if M3_MODULE not in sys.modules:
        spec = importlib.util.find_spec(PARENT_PACKAGES[0])
        if spec is None or spec.origin is None:
            raise ImportError("FlagEmbedding is not installed (pip install FlagEmbedding)")
        root = Path(spec.origin).parent
        for name in PARENT_PACKAGES:
            if name not in sys.modules:
                package = types.ModuleType(name)
                package.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
                sys.modules[name] = package
    return importlib.import_module(M3_MODULE).M3Embedder


@dataclass(frozen=True)
class M3Answers:
    """One side's answers per text: dense embeddings, term weights (id -> weight) and ColBERT vectors."""

    dense: np.ndarray
    lexical_weights: list[dict[int, float]]
    colbert_vectors: list[np.ndarray]


@dataclass(frozen=True)
class M3Reference:
    """FlagEmbedding's answers on the gate texts, and its ColBERT scores of some pairs of them."""

    library: str
    texts: list[str]
    labels: list[str]
    answers: M3Answers
    pairs: list[tuple[int, int]]
    """(query, passage) indices into texts."""
    scores: np.ndarray
    """colbert_score of each pair."""


def m3_reference(checkpoint: Checkpoint, sentences: list[str]) -> M3Reference:
    """BGEM3FlagModel(folder, use_fp16=False) on the gate sentences and their concatenation, on the CPU."""
    flag_model = bge_m3_flag_model()
    model = flag_model(str(checkpoint.folder), use_fp16=False, devices="cpu", colbert_dim=checkpoint.head.colbert_width)
    texts = [*sentences, " ".join(sentences)]
    labels = [f"input {i + 1}: {text[:40]!r}" for i, text in enumerate(sentences)] + [LONG_TEXT_LABEL]
    encoded = model.encode(
        texts,
        batch_size=LIBRARY_BATCH_SIZE,
        max_length=checkpoint.max_seq_length,
        return_dense=True,
        return_sparse=True,
        return_colbert_vecs=True,
    )
    answers = M3Answers(
        np.asarray(encoded["dense_vecs"], dtype=np.float32),
        [{int(token): float(weight) for token, weight in row.items()} for row in encoded["lexical_weights"]],
        [np.asarray(vectors, dtype=np.float32) for vectors in encoded["colbert_vecs"]],
    )
    pairs = [(i, (i + 1) % len(sentences)) for i in range(min(SCORED_PAIRS, len(sentences)))] + [(0, len(texts) - 1)]
    scores = np.array(
        [float(model.colbert_score(answers.colbert_vectors[q], answers.colbert_vectors[p])) for q, p in pairs]
    )
    version = importlib.metadata.version("FlagEmbedding")
    return M3Reference(f"FlagEmbedding {version}", texts, labels, answers, pairs, scores)


def served_answers(session: VariantSession, feeds: list[dict[str, np.ndarray]]) -> M3Answers:
    """A graph's answers per row of the feeds, read as the server reads them."""
    dense, lexical, vectors = [], [], []
    for feed in feeds:
        embedding, token_vectors, token_weights = session.run(["embedding", TOKEN_VECTORS, TOKEN_WEIGHTS], feed)
        dense.append(embedding)
        for row, mask in enumerate(feed["attention_mask"]):
            attended = np.nonzero(mask)[0]
            vectors.append(token_vectors[row, attended[1:]])
            weights: dict[int, float] = {}
            for token, weight in zip(feed["input_ids"][row, attended], token_weights[row, attended, 0], strict=True):
                if weight > 0:
                    weights[int(token)] = max(weights.get(int(token), 0.0), float(weight))
            lexical.append(weights)
    return M3Answers(np.concatenate(dense), lexical, vectors)


def maxsim_mean(query: np.ndarray, passage: np.ndarray) -> float:
    """MaxSim averaged over the query's vectors: each one's best match among the passage's."""
    return float((query.astype(np.float64) @ passage.astype(np.float64).T).max(axis=1).mean())


@dataclass
class _Worst:
    """The largest figure so far and where it was."""

    value: float = 0.0
    where: str = ""

    def see(self, value: float, where: str) -> None:
        if value > self.value:
            self.value, self.where = value, where


def _lexical_difference(ours: dict[int, float], theirs: dict[int, float]) -> tuple[float, int]:
    """The largest weight difference over both sides' ids (a missing id weighs 0), and how many ids one side lacks."""
    ids = set(ours) | set(theirs)
    largest = max((abs(ours.get(i, 0.0) - theirs.get(i, 0.0)) for i in ids), default=0.0)
    return largest, len(set(ours) ^ set(theirs))


def compare(reference: M3Reference, answers: list[M3Answers]) -> dict[str, object]:
    """Each way's answers (alone, batched) against the library: the worst figures, and what went wrong."""
    expected, labels = reference.answers, reference.labels
    row_cosines = np.min([cosines(way.dense, expected.dense) for way in answers], axis=0)
    dense_diff, sparse_diff, colbert_diff, score_diff = _Worst(), _Worst(), _Worst(), _Worst()
    lone_ids, count_misses = 0, []
    for way in answers:
        for row, label in enumerate(labels):
            dense_diff.see(float(np.abs(way.dense[row] - expected.dense[row]).max()), label)
            largest, only_one_side = _lexical_difference(way.lexical_weights[row], expected.lexical_weights[row])
            sparse_diff.see(largest, label)
            lone_ids += only_one_side
            ours, theirs = way.colbert_vectors[row], expected.colbert_vectors[row]
            if ours.shape != theirs.shape:
                count_misses.append(f"{label}: {len(ours)} vectors, FlagEmbedding {len(theirs)}")
                continue
            colbert_diff.see(float(np.abs(ours - theirs).max(initial=0.0)), label)
        for (query, passage), score in zip(reference.pairs, reference.scores, strict=True):
            ours_score = maxsim_mean(way.colbert_vectors[query], way.colbert_vectors[passage])
            score_diff.see(abs(ours_score - score), f"{labels[query]} against {labels[passage]}")
    worst_cosine = int(np.argmin(row_cosines))
    return {
        "dense": {
            "min_cosine": float(row_cosines[worst_cosine]),
            "worst_cosine_input": labels[worst_cosine],
            "max_abs_diff": dense_diff.value,
            "worst_diff_input": dense_diff.where,
        },
        "lexical_weights": {
            "max_abs_diff": sparse_diff.value,
            "worst_diff_input": sparse_diff.where,
            "ids_on_one_side_only": lone_ids,
        },
        "colbert_vecs": {
            "max_abs_diff": colbert_diff.value,
            "worst_diff_input": colbert_diff.where,
            "count_mismatches": count_misses,
        },
        "colbert_score": {
            "max_abs_diff": score_diff.value,
            "worst_pair": score_diff.where,
            "pairs": len(reference.pairs),
        },
    }


def failures_of(variant: str, figures: dict[str, object]) -> list[str]:
    """A variant's misses against FlagEmbedding, one line each."""
    against = "to FlagEmbedding's BGEM3FlagModel on the folder"
    failures = []
    dense = figures["dense"]
    if dense["min_cosine"] < MIN_COSINE:
        failures.append(
            f"{variant}: embedding cosine {dense['min_cosine']:.6f} < {MIN_COSINE} {against}"
            f" at {dense['worst_cosine_input']}"
        )
    for name, where in (("dense", "worst_diff_input"), ("lexical_weights", "worst_diff_input")):
        if figures[name]["max_abs_diff"] > MAX_ABS_DIFF:
            failures.append(
                f"{variant}: {name} max |diff| {figures[name]['max_abs_diff']:.3g} > {MAX_ABS_DIFF} {against}"
                f" at {figures[name][where]}"
            )
    colbert = figures["colbert_vecs"]
    if colbert["count_mismatches"]:
        failures.append(f"{variant}: colbert_vecs per text differ {against}: {colbert['count_mismatches'][0]}")
    if colbert["max_abs_diff"] > MAX_ABS_DIFF:
        failures.append(
            f"{variant}: colbert_vecs max |diff| {colbert['max_abs_diff']:.3g} > {MAX_ABS_DIFF} {against}"
            f" at {colbert['worst_diff_input']}"
        )
    score = figures["colbert_score"]
    if score["max_abs_diff"] > MAX_ABS_DIFF:
        failures.append(
            f"{variant}: MaxSim mean differs from colbert_score by {score['max_abs_diff']:.3g} > {MAX_ABS_DIFF}"
            f" {against} at {score['worst_pair']}"
        )
    return failures


def _rounded(figures: dict[str, object]) -> dict[str, object]:
    """Figures for parity.json: cosines to 8 places, differences to 3 significant digits."""
    rounded: dict[str, object] = {}
    for name, value in figures.items():
        if isinstance(value, dict):
            rounded[name] = _rounded(value)
        elif isinstance(value, float):
            rounded[name] = round(value, 8) if name == "min_cosine" else float(f"{value:.3g}")
        else:
            rounded[name] = value
    return rounded


def published_check(
    checkpoint: Checkpoint, tokenizer: TextTokenizer, input_names: list[str], sentences: list[str]
) -> VariantCheck:
    """FlagEmbedding's answers on the gate texts, as each published variant's check (figures for parity.json)."""
    try:
        reference = m3_reference(checkpoint, sentences)
    except Exception as error:  # whatever stops the library from answering: the folder cannot be checked
        failure = f"FlagEmbedding could not answer for {checkpoint.folder}: {type(error).__name__}: {error}"
        return unchecked(failure, failed=True)
    feeds = served_feeds(
        tokenizer,
        reference.texts,
        input_names,
        max_length=checkpoint.max_seq_length,
        pad_token_id=checkpoint.config.pad_token_id,
    )

    def check(variant: str, session: VariantSession) -> tuple[dict[str, object], list[str]]:
        figures = compare(reference, [served_answers(session, way) for way in feeds])
        variant_failures = failures_of(variant, figures)
        return {
            "library": reference.library,
            "class": "BGEM3FlagModel",
            "compared": (
                "encode(return_dense, return_sparse, return_colbert_vecs) at the model's max sequence length against"
                " embedding, each id's largest token weight and the token vectors of attended positions after the"
                " first; colbert_score against MaxSim averaged over the query's vectors"
            ),
            "provider": session.get_providers()[0],
            "rows": len(reference.texts),
            "required": {"min_cosine": MIN_COSINE, "max_abs_diff": MAX_ABS_DIFF},
            **_rounded(figures),
            "passed": not variant_failures,
        }, variant_failures

    return check
