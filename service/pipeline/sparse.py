"""Sparse embeddings (SPLADE, bge-m3): a text's weighted vocabulary ids as the terms it holds.

A sparse model's graph answers `sparse_embedding` [rows, vocab_size] (sentence-transformers'
SparseEncoder: log(1 + relu) of the masked-LM logits, max over tokens). Served as two outputs made
from it once the rows are back: `sparse_indices` (INT64) and `sparse_values` (FP32), each
[rows, k]: a row's non-zero terms, largest value first (ties by index), padded with index -1 and
value 0 to the longest row of the request. The `top_k` request parameter keeps each row's k
largest terms. TEI's POST /embed_sparse answers the same terms as [[{"index", "value"}]].

bge-m3's sparse head answers a weight per position instead (`token_weights`, [rows, sequence, 1]);
a text's term weight is the largest weight of its id (FlagEmbedding's lexical weights), the same
two outputs made from it with the rows' token ids.

The answer budget counts a sparse answer at the dense row it is made from (4 bytes x vocab_size a
text): that vector is what the server holds while the request runs. The answer as sent is then
checked against --max-response-bytes once its terms are known.
"""

from __future__ import annotations

import numpy as np

from service.core.rows import TokenRows
from service.errors import InvalidArgument
from service.pipeline.vocabulary import TOP_K


def top_k_choice(parameters: dict[str, object], sparse: bool, model: str) -> int | None:
    """The `top_k` parameter: keep each row's k largest terms (a sparse model's); None: every non-zero term."""
    value = parameters.get(TOP_K)
    if value is None:
        return None
    if not sparse:
        raise InvalidArgument(f"parameter {TOP_K}: model {model} answers no sparse embedding")
    if type(value) is not int or value < 1:
        raise InvalidArgument(f"parameter {TOP_K} must be a positive integer, got {value!r}")
    return value


def terms(dense: np.ndarray, top_k: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Each row's non-zero terms, largest first: indices int64 and values float32, [rows, k], padded with -1 / 0.

    Only a row's non-zero entries are sorted (a SPLADE row holds a few hundred of its vocabulary's tens of
    thousands); a stable sort of their indices, ascending, breaks ties by index.
    """
    kept = []
    for row in dense:
        indices = np.flatnonzero(row)
        order = np.argsort(-row[indices], kind="stable")[:top_k]
        kept.append((indices[order], row[indices[order]]))
    return _padded(kept)


def token_terms(rows: TokenRows, weights: np.ndarray, top_k: int | None) -> tuple[np.ndarray, np.ndarray]:
    """bge-m3's terms: each row's ids with a positive weight, at the largest weight of each id; as `terms` answers.

    weights: float32 [rows, width, 1], each position's weight (0 for special tokens and padding).
    """
    kept = []
    start = 0
    for row, length in enumerate(rows.lengths.tolist()):
        ids, own = rows.input_ids[start : start + length], weights[row, :length, 0]
        start += length
        positive = own > 0
        indices, where = np.unique(ids[positive], return_inverse=True)
        values = np.zeros(len(indices), dtype=np.float32)
        np.maximum.at(values, where, own[positive])
        order = np.argsort(-values, kind="stable")[:top_k]
        kept.append((indices[order], values[order]))
    return _padded(kept)


def _padded(kept: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Rows of (indices, values) as two [rows, k] arrays, padded with index -1 and value 0."""
    width = max((len(indices) for indices, _ in kept), default=0)
    term_indices = np.full((len(kept), width), -1, dtype=np.int64)
    term_values = np.zeros((len(kept), width), dtype=np.float32)
    for row, (indices, values) in enumerate(kept):
        term_indices[row, : len(indices)] = indices
        term_values[row, : len(indices)] = values
    return term_indices, term_values
