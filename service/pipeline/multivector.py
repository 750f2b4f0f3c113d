"""Multi-vector (late-interaction) embeddings: a text as its tokens' vectors, and a query's MaxSim score.

A multi-vector model's graph answers `token_vectors` [rows, sequence, width], every position's
L2-normalised vector; which positions are the text's is the model's rule (service.core.repository's
MultiVectorSpec), applied here to the rows as they were tokenised:
- ColBERT as PyLate saves it: documents keep their attended tokens except the skip list
  (punctuation); queries padded with expansion tokens keep every position up to the query length;
- bge-m3's ColBERT head: every attended position but the first ([CLS] / <s>).

Served as two outputs: `multivector` (FP32 [rows, n, width], each row's vectors then zeros up to the
request's longest row) and `multivector_lengths` (INT64 [rows]). With pairs (query[i], text[i]),
the model answers `score` (FP32 [rows, 1]): MaxSim, each query vector's best dot product with the
text's vectors, summed over the query's vectors (ColBERT) or averaged (bge-m3). That is what
/rerank, /v1/rerank and a gRPC request with a `query` input get from such a model.

The `input_type` request parameter says whether texts are queries or documents (default document);
it changes how a ColBERT model tokenises them.
"""

from __future__ import annotations

import numpy as np

from service.core.repository import ModelSpec
from service.core.rows import TokenRows
from service.core.text_rules import MultiVectorSpec
from service.errors import InvalidArgument
from service.pipeline.tokenizer import TextTokenizer
from service.pipeline.vocabulary import INPUT_TYPE

QUERY = "query"
DOCUMENT = "document"
INPUT_TYPES = (QUERY, DOCUMENT)


def input_type_choice(parameters: dict[str, object], spec: ModelSpec) -> str:
    """The `input_type` parameter (query or document; default document), for a multi-vector model only."""
    value = parameters.get(INPUT_TYPE)
    if value is None:
        return DOCUMENT
    if spec.multivector is None:
        raise InvalidArgument(
            f"parameter {INPUT_TYPE}: model {spec.name} is not a multi-vector model; its prompts are chosen by"
            " prompt_name"
        )
    if value not in INPUT_TYPES:
        raise InvalidArgument(f"parameter {INPUT_TYPE} must be {' or '.join(INPUT_TYPES)}, got {value!r}")
    return value


def row_length(spec: ModelSpec, input_type: str) -> int:
    """The most tokens a query's or a document's row takes (prefix and special tokens included)."""
    rules = spec.multivector
    length = rules.query_length if input_type == QUERY else rules.document_length
    return min(length or spec.max_sequence_length, spec.max_sequence_length)


def tokenized(tokenizer: TextTokenizer, spec: ModelSpec, texts: list[str], input_type: str) -> TokenRows:
    """Texts as the model's rules tokenise a query or a document: its prefix, its length, a query's expansion."""
    rules = spec.multivector
    query = input_type == QUERY
    return tokenizer.encode_marked_rows(
        texts,
        row_length(spec, input_type),
        rules.query_prefix_id if query else rules.document_prefix_id,
        rules.query_expansion_id if query else None,
        rules.attend_to_expansion_tokens,
    )


def kept_positions(rows: TokenRows, rules: MultiVectorSpec, input_type: str) -> list[np.ndarray]:
    """Each row's positions whose vectors are the text's, ascending."""
    starts = np.concatenate([[0], np.cumsum(rows.lengths)[:-1]])
    expanded = input_type == QUERY and rules.query_expansion_id is not None
    skip = np.array(rules.document_skip_ids, dtype=np.int64) if input_type == DOCUMENT else None
    kept = []
    for start, length in zip(starts.tolist(), rows.lengths.tolist(), strict=True):
        keep = np.ones(length, dtype=bool)
        if not expanded and rows.attention_mask is not None:
            keep &= rows.attention_mask[start : start + length] != 0
        if skip is not None and skip.size:
            keep &= ~np.isin(rows.input_ids[start : start + length], skip)
        if rules.skip_first_token:
            keep[0] = False
        kept.append(np.flatnonzero(keep))
    return kept


def row_vectors(token_vectors: np.ndarray, kept: list[np.ndarray]) -> list[np.ndarray]:
    """Each row's own vectors [n, width] from the graph's [rows, sequence, width]."""
    return [token_vectors[row, positions] for row, positions in enumerate(kept)]


def padded(vectors: list[np.ndarray], width: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of vectors as one array [rows, longest, width] (zeros after each row's own) and their lengths."""
    lengths = np.array([len(row) for row in vectors], dtype=np.int64)
    array = np.zeros((len(vectors), int(lengths.max(initial=0)), width), dtype=np.float32)
    for row, own in enumerate(vectors):
        array[row, : len(own)] = own
    return array, lengths


def maxsim(query: np.ndarray, document: np.ndarray, score: str) -> float:
    """MaxSim: each query vector's best dot product with the document's vectors, summed or averaged."""
    if not len(document):
        return 0.0
    best = (query @ document.T).max(axis=1)
    return float(best.sum() if score == "sum" else best.mean())
