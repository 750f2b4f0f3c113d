"""Texts longer than the model, in windows; and chunks of one document embedded in its context (late chunking).

With `truncate` false, an embedder's text over the model's length is split into windows of at most
that length, each with the model's special tokens, consecutive windows sharing
--chunk-overlap-tokens tokens (service.pipeline.tokenizer.encode_windows). The windows ride in
batches like any row; the text's vector is the mean of its windows' vectors weighted by their
tokens, L2-normalised again when the model normalises. For a mean-pooled model without
normalisation that is the mean over every window's tokens.

With `late_chunking` true, a request's texts are consecutive chunks of one document: the document
is encoded once (service.pipeline.tokenizer.encode_chunks: each chunk's tokens laid end to end
between the model's special tokens, within its length) and each chunk's vector is the mean of its
own tokens' final states, L2-normalised when the model normalises, whatever the model's pooling:
each chunk's vector has seen the whole document.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Windows:
    """How a request's texts were split: each text's window count, and each window's tokens (its weight)."""

    counts: np.ndarray
    """int64 [texts]."""
    tokens: np.ndarray
    """int64 [windows], the texts' windows in order."""


def combined(embeddings: np.ndarray, windows: Windows, normalize: bool) -> np.ndarray:
    """One vector a text from its windows' vectors [windows, width]: the token-weighted mean, normalised if asked."""
    weights = windows.tokens.astype(np.float32)[:, None]
    starts = np.concatenate([[0], np.cumsum(windows.counts)[:-1]])
    vectors = np.add.reduceat(embeddings * weights, starts, axis=0) / np.add.reduceat(weights, starts, axis=0)
    if normalize:
        vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    return vectors.astype(np.float32, copy=False)


def late_chunked(states: np.ndarray, spans: np.ndarray, normalize: bool) -> np.ndarray:
    """One vector a chunk: the mean of its span's token states (states [1, tokens, width]), normalised if asked."""
    vectors = np.stack([states[0, start:stop].mean(axis=0) for start, stop in spans.tolist()])
    if normalize:
        vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    return vectors.astype(np.float32, copy=False)
