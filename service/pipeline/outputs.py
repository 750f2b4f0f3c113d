"""The outputs a model answers: the graph's own, and those made from them once a request's rows are back.

Those made from the graph's (service.pipeline.shaping):

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

import numpy as np

from service.core.repository import TASK_OUTPUTS, TOKEN_VECTORS, TOKEN_WEIGHTS, ModelSpec
from service.errors import InvalidArgument
from service.pipeline.vocabulary import (
    CHUNK_COUNTS,
    CHUNKS,
    EMBEDDING,
    EMBEDDING_TYPES,
    INDICES,
    MULTIVECTOR,
    MULTIVECTOR_LENGTHS,
    OUTPUT_OF_TYPE,
    SCORE,
    SPARSE,
    TOKEN_COUNTS,
    TOKEN_IDS,
    TOKEN_OFFSETS,
    TOKEN_OUTPUTS,
    TOKENS,
    VALUES,
)

_NUMPY = {"FP32": np.dtype("<f4"), "INT8": np.dtype("i1"), "UINT8": np.dtype("u1"), "INT64": np.dtype("<i8")}
_GRAPH_DATATYPE = "FP32"
INTERNAL = (TOKEN_VECTORS, TOKEN_WEIGHTS)
"""Graph outputs only served through the outputs made from them."""
CALIBRATED_TYPES = ("int8", "uint8")
"""Embedding types that need the model's calibrated ranges."""
EMBEDDING_TYPE_DATATYPES = {"float": "FP32", "int8": "INT8", "uint8": "UINT8", "binary": "INT8", "ubinary": "UINT8"}
"""Each embedding type's KServe datatype."""


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
                outputs[name] = ServedOutput(name, EMBEDDING_TYPE_DATATYPES[kind], EMBEDDING, kind)
        if not spec.image_variants:  # a two-tower model's long-text windows are not gated: no chunks
            outputs[CHUNKS] = ServedOutput(CHUNKS, "FP32", EMBEDDING, CHUNKS)
            outputs[CHUNK_COUNTS] = ServedOutput(CHUNK_COUNTS, "INT64", EMBEDDING, CHUNK_COUNTS)
    sparse_source = SPARSE if SPARSE in graph else TOKEN_WEIGHTS if TOKEN_WEIGHTS in graph else None
    if sparse_source is not None:
        outputs[INDICES] = ServedOutput(INDICES, "INT64", sparse_source, INDICES)
        outputs[VALUES] = ServedOutput(VALUES, "FP32", sparse_source, VALUES)
    if TOKEN_VECTORS in graph:
        for name, datatype in ((MULTIVECTOR, "FP32"), (MULTIVECTOR_LENGTHS, "INT64")):
            outputs[name] = ServedOutput(name, datatype, TOKEN_VECTORS, name)
        outputs[SCORE] = ServedOutput(SCORE, "FP32", TOKEN_VECTORS, SCORE)
    if accepts_text:
        outputs |= {name: ServedOutput(name, "INT64", TOKENS, name) for name in TOKEN_OUTPUTS}
    return outputs


DEFAULT_NAMES = (
    *(name for names in TASK_OUTPUTS.values() for name in names if name not in INTERNAL),
    MULTIVECTOR,
    MULTIVECTOR_LENGTHS,
    SCORE,
)
"""Every output some model answers a request that names none (`default_outputs`)."""


def default_outputs(spec: ModelSpec, pairs: bool) -> tuple[str, ...]:
    """What a request naming no outputs gets: a multi-vector model's vectors (scores for pairs), else the graph's."""
    if spec.task == "multivector":
        return (SCORE,) if pairs else (MULTIVECTOR, MULTIVECTOR_LENGTHS)
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


def output_width(output: ServedOutput, width: int) -> int:
    """Values a row of this output holds when its source is `width` wide (-1: known only once the rows are back)."""
    if output.form in ("binary", "ubinary"):
        return math.ceil(width / 8)
    if output.form in (MULTIVECTOR_LENGTHS, SCORE, CHUNK_COUNTS, TOKEN_COUNTS):
        return 1
    return -1 if output.form in (INDICES, VALUES, MULTIVECTOR, TOKEN_IDS, TOKEN_OFFSETS) else width
