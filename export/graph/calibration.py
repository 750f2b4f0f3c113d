"""The embedding's calibrated ranges: what the server scales its int8 and uint8 embeddings by.

Each dimension's minimum and maximum over a calibration corpus (the gate sentences by default),
embedded by the fp32 model as the server would embed them (its default prompt before each text),
for every width the model serves (its own and each Matryoshka width, shortened as the server
shortens). Stored in the repository, they make an int8 answer independent of the batch it rode in,
and are sentence-transformers' `quantize_embeddings(..., ranges=...)` argument.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from export.checkpoints.checkpoint import Checkpoint
from export.gate import cases
from service.pipeline.embedding_types import shortened
from service.pipeline.tokenizer import TextTokenizer

BATCH = 16


def calibration_feeds(
    checkpoint: Checkpoint, tokenizer: TextTokenizer, input_names: list[str], corpus: Path
) -> list[dict[str, np.ndarray]]:
    """The corpus's texts as the server would embed them (the default prompt before each), in batches of BATCH."""
    texts = cases.read_sentences(corpus)
    if len(texts) < 2:
        raise ValueError(f"{corpus}: an embedding calibration corpus needs at least 2 texts, has {len(texts)}")
    serving = checkpoint.serving
    prefix = serving.prompts.get(serving.default_prompt_name, "")
    return [
        tokenizer.encode([prefix + text for text in texts[start : start + BATCH]]).feed(input_names)
        for start in range(0, len(texts), BATCH)
    ]


def calibration_ranges(
    checkpoint: Checkpoint, embeddings: np.ndarray, corpus: Path
) -> tuple[dict[int, np.ndarray], dict[str, object]]:
    """Width -> float32 [2, width] (minimums, maximums) of the embeddings, and what they rest on (for the report).

    embeddings: the fp32 model's answers for the corpus's calibration_feeds, in order.
    """
    serving = checkpoint.serving
    embeddings = embeddings.astype(np.float32)
    widths = (checkpoint.config.d_model, *serving.matryoshka_dimensions)
    ranges = {}
    for width in widths:
        vectors = (
            embeddings if width == embeddings.shape[1] else shortened(embeddings, width, checkpoint.config.normalize)
        )
        ranges[width] = np.stack([vectors.min(axis=0), vectors.max(axis=0)]).astype(np.float32)
    basis = {
        "corpus": corpus.name,
        "texts": len(embeddings),
        "prompt": serving.default_prompt_name or None,
        "widths": widths,
    }
    return ranges, basis
