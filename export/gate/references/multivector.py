"""A ColBERT model's last reference: sentence-transformers' MultiVectorEncoder on its folder, with PyLate's skip list.

Every published variant's token vectors, its texts tokenised, run and kept as the server does it, must
be the library's, text by text, and so must the MaxSim scores of every query with every document. The
skip list is PyLate's (`follow_pylate`): PyLate made the folder and scores with it.

The libraries are imported here only, when an export runs: the server never loads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from export.gate.cases import SENTENCE_BATCH
from export.gate.references.library import LIBRARY_BATCH_SIZE, LONG_TEXT_LABEL, quiet_loading, required_figures
from export.gate.references.loop import VariantCheck, VariantSession
from protocol import model_config_pb2 as mc
from service.core.fidelity import cosines
from service.core.repository import TOKEN_VECTORS, ModelSpec
from service.pipeline import multivector
from service.pipeline.tokenizer import TextTokenizer

if TYPE_CHECKING:  # the heads list these checks, and the checkpoint lists the heads
    from sentence_transformers import MultiVectorEncoder

    from export.checkpoints.checkpoint import Checkpoint

MAXSIM_MAX_ABS_DIFF = 1e-4
"""fp32's largest MaxSim difference from the library's (sum over a query's vectors of its best dot product)."""


@dataclass(frozen=True)
class MultiVectorFigures:
    """One published variant against MultiVectorEncoder: vector counts, each kept vector, and MaxSim scores."""

    provider: str
    min_cosine: float
    worst_cosine_input: str
    max_abs_diff: float
    worst_diff_input: str
    max_score_diff: float
    worst_score_pair: str
    texts: int
    failures: list[str]


def served_spec(checkpoint: Checkpoint, input_names: list[str]) -> ModelSpec:
    """The served model's spec as far as its multi-vector serving reads it (the rules and the window).

    The server reads the same fields from config.pbtxt (publish.build_config writes them from this checkpoint).
    """
    colbert = checkpoint.head
    return ModelSpec(
        name=checkpoint.name,
        version="1",
        directory=checkpoint.folder,
        config=mc.ModelConfig(),
        variants={},
        preferred_variants={},
        input_names=tuple(input_names),
        max_sequence_length=checkpoint.max_seq_length,
        vocab_size=checkpoint.config.vocab_size,
        type_vocab_size=0,
        hidden_size=0,
        pad_token_id=checkpoint.config.pad_token_id,
        tokenizer_file=checkpoint.folder / "tokenizer.json",
        task="multivector",
        multivector=colbert.rules,
        multivector_width=colbert.out_features,
    )


def served_vectors(
    session: VariantSession,
    tokenizer: TextTokenizer,
    spec: ModelSpec,
    texts: list[str],
    *,
    input_type: str,
    batch_size: int,
) -> list[np.ndarray]:
    """Each text's kept vectors as the server makes them: its tokenisation, the graph, its kept positions."""
    vectors = []
    for start in range(0, len(texts), batch_size):
        rows = multivector.tokenized(tokenizer, spec, texts[start : start + batch_size], input_type)
        feed = rows.padded(spec.pad_token_id)
        (token_vectors,) = session.run([TOKEN_VECTORS], {name: feed[name] for name in spec.input_names})
        vectors += multivector.row_vectors(
            token_vectors, multivector.kept_positions(rows, spec.multivector, input_type)
        )
    return vectors


def _vector_figures(
    served: list[np.ndarray], expected: list[np.ndarray], labels: list[str]
) -> tuple[float, str, float, str, list[str]]:
    """Least cosine and largest difference over every kept vector, and the texts whose vector counts differ."""
    min_cosine, worst_cosine, max_diff, worst_diff, counts = 1.0, "", 0.0, "", []
    for ours, theirs, label in zip(served, expected, labels, strict=True):
        if ours.shape != theirs.shape:
            counts.append(f"{label}: {len(ours)} vectors, the library {len(theirs)}")
            continue
        row_cosines, row_diff = cosines(ours, theirs), float(np.abs(ours - theirs).max(initial=0.0))
        if len(row_cosines) and row_cosines.min() < min_cosine:
            min_cosine, worst_cosine = float(row_cosines.min()), label
        if row_diff > max_diff:
            max_diff, worst_diff = row_diff, label
    return min_cosine, worst_cosine, max_diff, worst_diff, counts


def measure_multivector(
    session: VariantSession,
    variant: str,
    tokenizer: TextTokenizer,
    spec: ModelSpec,
    *,
    texts: list[str],
    expected: dict[str, list[np.ndarray]],
) -> MultiVectorFigures:
    """A variant's kept vectors (each text alone and in batches: both must agree) and MaxSim against the library's."""
    labels = [f"input {i + 1}: {text[:40]!r}" for i, text in enumerate(texts[:-1])] + [LONG_TEXT_LABEL]
    figures, failures, served = [], [], {}
    for input_type in multivector.INPUT_TYPES:
        for batch_size in (1, SENTENCE_BATCH):
            ours = served_vectors(session, tokenizer, spec, texts, input_type=input_type, batch_size=batch_size)
            named = [f"{input_type} {label} ({'alone' if batch_size == 1 else 'batched'})" for label in labels]
            figures.append(_vector_figures(ours, expected[input_type], named))
            served[input_type] = ours
    min_cosine, worst_cosine = min((f[0], f[1]) for f in figures)
    max_diff, worst_diff = max((f[2], f[3]) for f in figures)
    counts = [count for f in figures for count in f[4]]
    against = "sentence-transformers' MultiVectorEncoder on the folder (PyLate's skip list)"
    if counts:
        failures.append(f"{variant}: kept vector counts differ from {against}: {'; '.join(counts[:3])}")
    required = required_figures(variant, TOKEN_VECTORS)
    if min_cosine < required["min_cosine"]:
        failures.append(f"{variant}: token vector cosine {min_cosine:.6f} < {required['min_cosine']} at {worst_cosine}")
    if "max_abs_diff" in required and max_diff > required["max_abs_diff"]:
        failures.append(
            f"{variant}: token vector max |diff| {max_diff:.3g} > {required['max_abs_diff']} at {worst_diff}"
        )
    max_score_diff, worst_pair = 0.0, ""
    if not counts:
        score = spec.multivector.score
        for i, query in enumerate(served[multivector.QUERY]):
            for j, document in enumerate(served[multivector.DOCUMENT]):
                theirs = multivector.maxsim(expected[multivector.QUERY][i], expected[multivector.DOCUMENT][j], score)
                diff = abs(multivector.maxsim(query, document, score) - theirs)
                if diff > max_score_diff:
                    max_score_diff, worst_pair = diff, f"query {labels[i]} x document {labels[j]}"
        if variant == "fp32" and max_score_diff > MAXSIM_MAX_ABS_DIFF:
            failures.append(f"{variant}: MaxSim |diff| {max_score_diff:.3g} > {MAXSIM_MAX_ABS_DIFF} at {worst_pair}")
    return MultiVectorFigures(
        session.get_providers()[0],
        min_cosine,
        worst_cosine,
        max_diff,
        worst_diff,
        max_score_diff,
        worst_pair,
        len(texts),
        failures,
    )


def follow_pylate(encoder: MultiVectorEncoder) -> None:
    """MultiVectorEncoder's skip list made PyLate's, which made the folder and scores with it.

    PyLate maps a skiplist word missing from the vocabulary to the unknown token (transformers'
    `convert_tokens_to_ids`), so a document's unknown tokens are dropped; MultiVectorEncoder leaves such
    words out and keeps them. Where the skip list has such a word, the unknown token joins it.
    """
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask  # noqa: PLC0415  (build-time only)

    tokenizer = encoder.tokenizer
    unknown, unknown_id = tokenizer.unk_token, tokenizer.unk_token_id
    for module in encoder:
        if not isinstance(module, MultiVectorMask) or unknown is None:
            continue
        words = module.skiplist_words
        if any(tokenizer.convert_tokens_to_ids(word) == unknown_id for word in words) and unknown not in words:
            module.skiplist_words = [*words, unknown]
            module.resolve_with_tokenizer(tokenizer)


def multivector_check(
    checkpoint: Checkpoint, tokenizer: TextTokenizer, input_names: list[str], sentences: list[str]
) -> VariantCheck:
    """MultiVectorEncoder's encode_query/encode_document, as each published variant's check (fed as the server feeds).

    The gate sentences, and all of them as one text (longer than document_length: truncation), as
    queries and as documents: the same vectors kept per text, each within the variant's bounds, and
    the same MaxSim scores for every query and document. The skip list is PyLate's (`follow_pylate`).
    """
    import sentence_transformers  # noqa: PLC0415  (build-time only: the server never imports it)

    texts = [*sentences, " ".join(sentences)]
    with quiet_loading():
        encoder = sentence_transformers.MultiVectorEncoder(
            str(checkpoint.folder), device="cpu", local_files_only=True, model_kwargs={"dtype": torch.float32}
        )
    follow_pylate(encoder)
    expected = {
        multivector.QUERY: encoder.encode_query(
            texts, batch_size=LIBRARY_BATCH_SIZE, convert_to_numpy=True, show_progress_bar=False
        ),
        multivector.DOCUMENT: encoder.encode_document(
            texts, batch_size=LIBRARY_BATCH_SIZE, convert_to_numpy=True, show_progress_bar=False
        ),
    }
    expected = {kind: [np.asarray(v, dtype=np.float32) for v in vectors] for kind, vectors in expected.items()}
    spec = served_spec(checkpoint, input_names)

    def check(variant: str, session: VariantSession) -> tuple[dict[str, object], list[str]]:
        figures = measure_multivector(session, variant, tokenizer, spec, texts=texts, expected=expected)
        return {
            "library": f"sentence-transformers {sentence_transformers.__version__}",
            "class": "MultiVectorEncoder",
            "compared": (
                "encode_query and encode_document vectors (PyLate's skip list), text by text (the same count, each"
                " vector), and MaxSim of every query with every document; ours through the server's tokenisation"
                " and kept positions, each text alone and in batches"
            ),
            "provider": figures.provider,
            "min_cosine": round(figures.min_cosine, 8),
            "worst_cosine_input": figures.worst_cosine_input,
            "max_abs_diff": float(f"{figures.max_abs_diff:.3g}"),
            "worst_diff_input": figures.worst_diff_input,
            "maxsim_max_abs_diff": float(f"{figures.max_score_diff:.3g}"),
            "worst_maxsim_pair": figures.worst_score_pair,
            "texts": figures.texts,
            "required": required_figures(variant, TOKEN_VECTORS) | {"maxsim_max_abs_diff": MAXSIM_MAX_ABS_DIFF},
            "passed": not figures.failures,
        }, figures.failures

    return check
