"""Embeddings against a reference, row by row: their direction (cosine) and their values (largest difference).

A cosine alone cannot see a vector that points the right way at the wrong length (a scale or a
normalisation gone wrong), which matters for models whose embeddings are not normalised: every
comparison here checks the values too, relative to the size of the reference row.
"""

from __future__ import annotations

import numpy as np

FP32_RELATIVE_DIFF = 1e-4
"""fp32 ONNX Runtime (or another fp32 implementation) against fp32 PyTorch: each value within this fraction of
its reference row's L2 norm (1e-4 absolute for a normalised embedding; the export gate holds fp32 hidden states
to 1e-4 too)."""


def row_cosines(got: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """The cosine of each row of `got` with the same row of `expected`, in float64: a.b / (|a| |b|)."""
    a, b = got.astype(np.float64), expected.astype(np.float64)
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def relative_differences(got: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """Each row's largest absolute difference, over that row's L2 norm in `expected`."""
    a, b = got.astype(np.float64), expected.astype(np.float64)
    return np.abs(a - b).max(axis=1) / np.linalg.norm(b, axis=1)


def assert_same_vectors(
    got: np.ndarray, expected: np.ndarray, *, min_cosine: float, relative_diff: float = FP32_RELATIVE_DIFF
) -> None:
    """Same shape; every row's cosine >= min_cosine and its largest |difference| <= relative_diff x its norm."""
    assert got.shape == expected.shape, (got.shape, expected.shape)
    similarity = row_cosines(got, expected)
    worst = int(np.argmin(similarity))
    assert similarity[worst] >= min_cosine, f"row {worst}: cosine {similarity[worst]:.8f} < {min_cosine}"
    differences = relative_differences(got, expected)
    worst = int(np.argmax(differences))
    assert differences[worst] <= relative_diff, (
        f"row {worst}: largest difference {differences[worst]:.3g} of the row's norm > {relative_diff}"
        f" (got {got[worst][:4]}..., expected {expected[worst][:4]}...)"
    )
