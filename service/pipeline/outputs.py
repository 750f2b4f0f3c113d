"""The outputs a model answers: the graph's own, and those made from them once a request's rows are back.

- an embedder's `embedding` in its compact forms (service.pipeline.embedding_types);
- sparse terms `sparse_indices` / `sparse_values` (service.pipeline.sparse), from a SPLADE model's
  `sparse_embedding` or from bge-m3's per-position `token_weights`;
- multi-vector `multivector` / `multivector_lengths`, and the pairs' `score`
  (service.pipeline.multivector), from `token_vectors`;
- the texts' tokens `token_ids` / `token_offsets` / `token_counts`, from no graph output at all: a
  request asking for them alone is answered by the tokenizer, without running the model.

`token_vectors` and `token_weights` themselves are not served: which positions belong to a text is
only known with the rows' tokens. A request naming no outputs gets the model's defaults: the
graph's own served outputs, or a multi-vector model's vectors (or scores, for pairs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from service.core.repository import TASK_OUTPUTS, TOKEN_VECTORS, TOKEN_WEIGHTS, ModelSpec
from service.core.rows import TokenRows
from service.errors import InvalidArgument
from service.pipeline import multivector
from service.pipeline.embedding_types import (
    CALIBRATED_TYPES,
    DATATYPES,
    EMBEDDING,
    EMBEDDING_TYPES,
    OUTPUT_OF_TYPE,
    quantize,
    shortened,
)
from service.pipeline.sparse import INDICES, SPARSE, VALUES, terms, token_terms

if TYPE_CHECKING:
    from service.pipeline.validation import ModelSignature, ValidRequest

_NUMPY = {"FP32": np.dtype("<f4"), "INT8": np.dtype("i1"), "UINT8": np.dtype("u1"), "INT64": np.dtype("<i8")}
_GRAPH_DATATYPE = "FP32"
INTERNAL = (TOKEN_VECTORS, TOKEN_WEIGHTS)
"""Graph outputs only served through the outputs made from them."""
CHUNKS = "chunk_embeddings"
"""Each window's own vector, texts' windows in order (`truncate` false: service.pipeline.long_texts)."""
CHUNK_COUNTS = "chunk_counts"
"""Each text's windows (1 for a text within the model's length)."""
TOKENS = "tokens"
"""The source of the token outputs: the request's texts as the model's tokenizer reads them (no graph output)."""
TOKEN_IDS = "token_ids"
"""Each text's token ids, padded with -1."""
TOKEN_OFFSETS = "token_offsets"
"""Each token's [start, stop) in its text (characters, the prompt's prefix included); (-1, -1) for special tokens
and padding."""
TOKEN_COUNTS = "token_counts"
"""Each text's tokens."""
TOKEN_OUTPUTS = (TOKEN_IDS, TOKEN_OFFSETS, TOKEN_COUNTS)


def asks_for_tokens(outputs: tuple[str, ...]) -> bool:
    """Whether requested outputs (checked: token outputs come alone) are the texts' tokens."""
    return bool(outputs) and outputs[0] in TOKEN_OUTPUTS


@dataclass(frozen=True, slots=True)
class ServedOutput:
    """One output a model answers: the graph's own (`form` None) or one made from a graph output."""

    name: str
    datatype: str
    """KServe datatype: FP32, INT8, UINT8 or INT64."""
    source: str
    """The graph output it is made from (itself for the graph's own)."""
    form: str | None = None
    """What it is of its source: an embedding type (int8, uint8, binary, ubinary), sparse terms
    (sparse_indices, sparse_values), multi-vector (multivector, multivector_lengths, score), tokens
    (token_ids, token_offsets, token_counts); None for the graph's own."""

    @property
    def itemsize(self) -> int:
        """Bytes one value takes raw."""
        return _NUMPY[self.datatype].itemsize


def served_outputs(spec: ModelSpec, accepts_text: bool) -> dict[str, ServedOutput]:
    """Every output the model answers, by name: the graph's, the forms made from them, then (for text) the tokens."""
    graph = spec.output_names
    outputs = {name: ServedOutput(name, _GRAPH_DATATYPE, name) for name in graph if name not in INTERNAL}
    if EMBEDDING in outputs:
        for kind in EMBEDDING_TYPES[1:]:
            if kind not in CALIBRATED_TYPES or spec.embedding_ranges:
                name = OUTPUT_OF_TYPE[kind]
                outputs[name] = ServedOutput(name, DATATYPES[kind], EMBEDDING, kind)
        outputs[CHUNKS] = ServedOutput(CHUNKS, "FP32", EMBEDDING, CHUNKS)
        outputs[CHUNK_COUNTS] = ServedOutput(CHUNK_COUNTS, "INT64", EMBEDDING, CHUNK_COUNTS)
    sparse_source = SPARSE if SPARSE in graph else TOKEN_WEIGHTS if TOKEN_WEIGHTS in graph else None
    if sparse_source is not None:
        outputs[INDICES] = ServedOutput(INDICES, "INT64", sparse_source, INDICES)
        outputs[VALUES] = ServedOutput(VALUES, "FP32", sparse_source, VALUES)
    if TOKEN_VECTORS in graph:
        for name, datatype in ((multivector.MULTIVECTOR, "FP32"), (multivector.LENGTHS, "INT64")):
            outputs[name] = ServedOutput(name, datatype, TOKEN_VECTORS, name)
        outputs[multivector.SCORE] = ServedOutput(multivector.SCORE, "FP32", TOKEN_VECTORS, multivector.SCORE)
    if accepts_text:
        outputs |= {name: ServedOutput(name, "INT64", TOKENS, name) for name in TOKEN_OUTPUTS}
    return outputs


DEFAULT_NAMES = (
    *(name for names in TASK_OUTPUTS.values() for name in names if name not in INTERNAL),
    multivector.MULTIVECTOR,
    multivector.LENGTHS,
    multivector.SCORE,
)
"""Every output some model answers a request that names none (`default_outputs`)."""


def default_outputs(spec: ModelSpec, pairs: bool) -> tuple[str, ...]:
    """What a request naming no outputs gets: a multi-vector model's vectors (scores for pairs), else the graph's."""
    if spec.task == "multivector":
        return (multivector.SCORE,) if pairs else (multivector.MULTIVECTOR, multivector.LENGTHS)
    return tuple(name for name in spec.output_names if name not in INTERNAL)


def check_output(name: str, spec: ModelSpec, outputs: dict[str, ServedOutput]) -> ServedOutput:
    """The served output of that name among the model's `outputs`; InvalidArgument naming what it answers instead."""
    output = outputs.get(name)
    if output is not None:
        return output
    if spec.task == "embed" and name in (OUTPUT_OF_TYPE[kind] for kind in CALIBRATED_TYPES):
        raise InvalidArgument(
            f"output {name}: model {spec.name} has no calibrated embedding ranges (its repository predates them);"
            " export it again to serve int8 and uint8 embeddings"
        )
    raise InvalidArgument(f"unknown output {name!r} (outputs: {', '.join(outputs)})")


def type_output(kind: object, signature: ModelSignature, field: str) -> str:
    """The output serving an embedding type a request names in `field`; a precise refusal if the model has none."""
    if kind not in EMBEDDING_TYPES:
        raise InvalidArgument(f"{field} must be one of {', '.join(EMBEDDING_TYPES)}, got {kind!r}")
    check_output(OUTPUT_OF_TYPE[kind], signature.spec, signature.outputs)
    return OUTPUT_OF_TYPE[kind]


def output_width(output: ServedOutput, width: int) -> int:
    """Values a row of this output holds when its source is `width` wide (-1: known only once the rows are back)."""
    if output.form in ("binary", "ubinary"):
        return math.ceil(width / 8)
    if output.form in (multivector.LENGTHS, multivector.SCORE, CHUNK_COUNTS, TOKEN_COUNTS):
        return 1
    return -1 if output.form in (INDICES, VALUES, multivector.MULTIVECTOR, TOKEN_IDS, TOKEN_OFFSETS) else width


def answer_outputs(
    signature: ModelSignature, request: ValidRequest, graph: dict[str, np.ndarray], rows: TokenRows
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
    if forms & {multivector.MULTIVECTOR, multivector.LENGTHS, multivector.SCORE}:
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
        return {multivector.MULTIVECTOR: array, multivector.LENGTHS: lengths[:, None]}
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
    return {multivector.SCORE: scores[:, None]}
