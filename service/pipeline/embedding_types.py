"""The embedding in every form users store it: float, int8, uint8, binary and ubinary, and the outputs serving them.

The graph answers one float32 `embedding`; the compact forms are served outputs made from it after
its rows come back (`embedding_int8`, `embedding_uint8`, `embedding_binary`, `embedding_ubinary`),
with sentence-transformers' conventions (`quantize_embeddings`), so a vector database fed by either
holds the same codes:

- int8 / uint8: each dimension scaled from its calibrated [min, max] onto 256 steps,
  `floor((x - min) / ((max - min) / 255))`, clipped to 0..255, minus 128 for int8 (a dimension whose
  range is one value takes steps of 1). The ranges were measured at export over a calibration corpus
  and stored in the repository, so an answer never depends on the batch it rode in.
- binary / ubinary: one bit a dimension (1 where the value is > 0), packed eight to a byte, first
  dimension in the highest bit; ubinary as uint8, binary as those bytes minus 128 (int8). A row of d
  dimensions takes ceil(d / 8) bytes.

A request that names no outputs gets the graph's own; compact ones are answered when named
(docs/decisions.md#compact-embeddings-as-named-outputs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from service.core.repository import ModelSpec
from service.errors import InvalidArgument
from service.pipeline.sparse import INDICES, SPARSE, VALUES, terms

if TYPE_CHECKING:
    from service.pipeline.validation import ModelSignature

EMBEDDING = "embedding"
TOKEN_STATES = "last_hidden_state"
EMBEDDING_TYPES = ("float", "int8", "uint8", "binary", "ubinary")
"""Every form of the embedding, as Cohere's `embedding_types` and sentence-transformers' `precision` name them."""
OUTPUT_OF_TYPE = {"float": EMBEDDING, **{kind: f"{EMBEDDING}_{kind}" for kind in EMBEDDING_TYPES[1:]}}
"""Each form's served output name."""
CALIBRATED_TYPES = ("int8", "uint8")
"""Forms that need the model's calibrated ranges."""
_DATATYPES = {"float": "FP32", "int8": "INT8", "uint8": "UINT8", "binary": "INT8", "ubinary": "UINT8"}
_NUMPY = {"FP32": np.dtype("<f4"), "INT8": np.dtype("i1"), "UINT8": np.dtype("u1"), "INT64": np.dtype("<i8")}
_GRAPH_DATATYPE = "FP32"


@dataclass(frozen=True, slots=True)
class ServedOutput:
    """One output a model answers: the graph's own (`form` None) or a form of its embedding."""

    name: str
    datatype: str
    """KServe datatype: FP32, INT8 or UINT8."""
    source: str
    """The graph output it is made from (itself for the graph's own)."""
    form: str | None = None
    """What it is of its source: an embedding type (int8, uint8, binary, ubinary), a sparse embedding's
    terms (sparse_indices, sparse_values); None for the graph's own."""

    @property
    def itemsize(self) -> int:
        """Bytes one value takes raw."""
        return _NUMPY[self.datatype].itemsize


def served_outputs(spec: ModelSpec) -> dict[str, ServedOutput]:
    """Every output the model answers, by name: the graph's, then the forms of its embedding it can give."""
    outputs = {name: ServedOutput(name, _GRAPH_DATATYPE, name) for name in spec.output_names}
    if EMBEDDING in outputs:
        for kind in EMBEDDING_TYPES[1:]:
            if kind not in CALIBRATED_TYPES or spec.embedding_ranges:
                name = OUTPUT_OF_TYPE[kind]
                outputs[name] = ServedOutput(name, _DATATYPES[kind], EMBEDDING, kind)
    if SPARSE in outputs:
        outputs[INDICES] = ServedOutput(INDICES, "INT64", SPARSE, INDICES)
        outputs[VALUES] = ServedOutput(VALUES, "FP32", SPARSE, VALUES)
    return outputs


def embedding_types(spec: ModelSpec) -> list[str]:
    """The forms of its embedding a model gives ([] for a classifier)."""
    outputs = served_outputs(spec)
    return [kind for kind in EMBEDDING_TYPES if OUTPUT_OF_TYPE[kind] in outputs]


def type_output(kind: object, signature: ModelSignature, field: str) -> str:
    """The output serving an embedding type a request names in `field`; a precise refusal if the model has none."""
    if kind not in EMBEDDING_TYPES:
        raise InvalidArgument(f"{field} must be one of {', '.join(EMBEDDING_TYPES)}, got {kind!r}")
    check_output(OUTPUT_OF_TYPE[kind], signature.spec, signature.outputs)
    return OUTPUT_OF_TYPE[kind]


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
    """Values a row of this output holds when its source is `width` wide (-1: as many as the row's terms)."""
    if output.form in ("binary", "ubinary"):
        return math.ceil(width / 8)
    return -1 if output.form in (INDICES, VALUES) else width


def shortened(embeddings: np.ndarray, width: int, normalize: bool) -> np.ndarray:
    """Matryoshka embeddings cut to their first `width` values, L2-normalised again when the model normalises."""
    cut = np.ascontiguousarray(embeddings[:, :width])
    if normalize:
        cut /= np.maximum(np.linalg.norm(cut, axis=1, keepdims=True), 1e-12)
    return cut


def quantize(embeddings: np.ndarray, kind: str, ranges: np.ndarray | None = None) -> np.ndarray:
    """Float32 embeddings [rows, width] in one compact form (ranges: [2, width] minimum and maximum, for int8/uint8)."""
    if kind == "float":
        return embeddings
    if kind in ("binary", "ubinary"):
        packed = np.packbits(embeddings > 0, axis=1)
        return (packed.astype(np.int16) - 128).astype(np.int8) if kind == "binary" else packed
    starts = ranges[0]
    steps = (ranges[1] - starts) / np.float32(255)
    steps = np.where(steps == 0, np.float32(1), steps)
    codes = np.clip(np.floor((embeddings - starts) / steps), 0, 255)
    return (codes - 128).astype(np.int8) if kind == "int8" else codes.astype(np.uint8)


def answer_outputs(
    signature: ModelSignature,
    requested: tuple[str, ...],
    graph: dict[str, np.ndarray],
    dimensions: int | None,
    top_k: int | None = None,
) -> dict[str, np.ndarray]:
    """The requested outputs, in order, from the graph's.

    The embedding shortened to `dimensions`, and its forms; a sparse embedding's terms (its `top_k` largest).
    """
    spec, outputs = signature.spec, signature.outputs
    embedding = graph.get(EMBEDDING)
    if embedding is not None and dimensions is not None:
        embedding = shortened(embedding, dimensions, spec.normalize)
    sparse = {}
    if any(outputs[name].form in (INDICES, VALUES) for name in requested):
        sparse[INDICES], sparse[VALUES] = terms(graph[SPARSE], top_k)
    answer = {}
    for name in requested:
        output = outputs[name]
        if output.form in (INDICES, VALUES):
            answer[name] = sparse[name]
        elif output.source != EMBEDDING:
            answer[name] = graph[name]
        elif output.form is None:
            answer[name] = embedding
        else:
            width = embedding.shape[1]
            ranges = spec.embedding_ranges.get(width) if output.form in CALIBRATED_TYPES else None
            answer[name] = quantize(embedding, output.form, ranges)
    return answer
