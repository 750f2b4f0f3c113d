"""A request's outputs, made from the graph's outputs for its rows once they are back.

The embedding shortened to the request's dimensions and in its compact forms
(service.pipeline.embedding_types), sparse terms (service.pipeline.sparse), a multi-vector model's
vectors or its pairs' scores (service.pipeline.multivector), each window's vector: whatever the
request named among its model's served outputs (service.pipeline.outputs), in its order.
"""

from __future__ import annotations

import numpy as np

from service.core.repository import TOKEN_VECTORS, TOKEN_WEIGHTS, ModelSpec
from service.core.rows import Rows, TokenRows
from service.pipeline import multivector
from service.pipeline.embedding_types import quantize, shortened
from service.pipeline.outputs import CALIBRATED_TYPES
from service.pipeline.requests import ModelSignature, ValidRequest
from service.pipeline.sparse import terms, token_terms
from service.pipeline.vocabulary import (
    CHUNK_COUNTS,
    CHUNKS,
    EMBEDDING,
    INDICES,
    MULTIVECTOR,
    MULTIVECTOR_LENGTHS,
    SCORE,
    SPARSE,
    VALUES,
)


def answer_outputs(
    signature: ModelSignature, request: ValidRequest, graph: dict[str, np.ndarray], rows: Rows
) -> dict[str, np.ndarray]:
    """The request's outputs, in order, from the graph's outputs for its `rows` (as tokenised).

    The embedding shortened to the request's dimensions, and its forms; sparse terms (the `top_k`
    largest); a multi-vector model's vectors of each text, or the pairs' scores.
    """
    spec, outputs, requested = signature.spec, signature.outputs, request.outputs
    forms = {outputs[name].form for name in requested}
    embedding = graph.get(EMBEDDING)
    if embedding is not None and request.dimensions is not None:
        embedding = shortened(embedding, request.dimensions, spec.normalize)
    made: dict[str, np.ndarray] = {}
    if forms & {INDICES, VALUES}:
        if SPARSE in graph:
            made[INDICES], made[VALUES] = terms(graph[SPARSE], request.top_k)
        else:
            made[INDICES], made[VALUES] = token_terms(rows, graph[TOKEN_WEIGHTS], request.top_k)
    if forms & {MULTIVECTOR, MULTIVECTOR_LENGTHS, SCORE}:
        made |= _multivector_outputs(spec, request, graph[TOKEN_VECTORS], rows)
    answer = {}
    for name in requested:
        output = outputs[name]
        if output.form in made:
            answer[name] = made[output.form]
        elif output.source != EMBEDDING:
            answer[name] = graph[name]
        elif output.form is None:
            answer[name] = embedding
        elif output.form == CHUNKS:
            chunks = graph.get(CHUNKS, graph[EMBEDDING])
            answer[name] = (
                chunks if request.dimensions is None else shortened(chunks, request.dimensions, spec.normalize)
            )
        elif output.form == CHUNK_COUNTS:
            answer[name] = graph.get(CHUNK_COUNTS, np.ones((len(embedding), 1), dtype=np.int64))
        else:
            ranges = spec.embedding_ranges.get(embedding.shape[1]) if output.form in CALIBRATED_TYPES else None
            answer[name] = quantize(embedding, output.form, ranges)
    return answer


def _multivector_outputs(
    spec: ModelSpec, request: ValidRequest, token_vectors: np.ndarray, rows: TokenRows
) -> dict[str, np.ndarray]:
    """Each text's vectors and their counts; for pairs, each pair's MaxSim (queries' rows first, then the texts')."""
    rules = spec.multivector
    if request.queries is None:
        vectors = multivector.row_vectors(token_vectors, multivector.kept_positions(rows, rules, request.input_type))
        array, lengths = multivector.padded(vectors, spec.multivector_width)
        return {MULTIVECTOR: array, MULTIVECTOR_LENGTHS: lengths[:, None]}
    distinct = {query: index for index, query in enumerate(dict.fromkeys(request.queries))}
    queries = len(distinct)
    query_rows, text_rows = rows.split(queries)
    query_vectors = multivector.row_vectors(
        token_vectors[:queries], multivector.kept_positions(query_rows, rules, multivector.QUERY)
    )
    text_vectors = multivector.row_vectors(
        token_vectors[queries:], multivector.kept_positions(text_rows, rules, multivector.DOCUMENT)
    )
    scores = np.array(
        [
            multivector.maxsim(query_vectors[distinct[query]], text_vectors[row], rules.score)
            for row, query in enumerate(request.queries)
        ],
        dtype=np.float32,
    )
    return {SCORE: scores[:, None]}
