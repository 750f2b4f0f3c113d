"""The embedding in every form users store it: float, int8, uint8, binary and ubinary.

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
(docs/decisions.md#compact-embeddings-as-named-outputs); service.pipeline.shaping makes them.
"""

from __future__ import annotations

import numpy as np

from service.errors import InvalidArgument
from service.pipeline.outputs import check_output
from service.pipeline.requests import ModelSignature
from service.pipeline.vocabulary import EMBEDDING_TYPES, OUTPUT_OF_TYPE


def embedding_types(signature: ModelSignature) -> list[str]:
    """The forms of its embedding a model gives ([] for a model without one)."""
    return [kind for kind in EMBEDDING_TYPES if OUTPUT_OF_TYPE[kind] in signature.outputs]


def type_output(kind: object, signature: ModelSignature, field: str) -> str:
    """The output serving an embedding type a request names in `field`; a precise refusal if the model has none."""
    if kind not in EMBEDDING_TYPES:
        raise InvalidArgument(f"{field} must be one of {', '.join(EMBEDDING_TYPES)}, got {kind!r}")
    check_output(OUTPUT_OF_TYPE[kind], signature.spec, signature.outputs)
    return OUTPUT_OF_TYPE[kind]


def shortened(embeddings: np.ndarray, width: int, normalize: bool) -> np.ndarray:
    """Matryoshka embeddings cut to their first `width` values, L2-normalised again when the model normalises."""
    cut = embeddings[:, :width]
    if normalize:  # a new array: the rows may be a read-only view of the engine's answer
        return cut / np.maximum(np.linalg.norm(cut, axis=1, keepdims=True), 1e-12)
    return np.ascontiguousarray(cut)


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
