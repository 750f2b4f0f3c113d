"""What a user of the server gets, measured beside the parity gate.

Each sentence through the server's tokenizer configuration, alone and in padded batches, `embedding`
out, against the model run on that sentence alone; and the rows stored for the server's own check at load.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from export.gate.cases import (
    GATE_ADAPTER_IDS,
    MASK_STYLES,
    SENTENCE_BATCH,
    encode,
    holed,
    left_padded,
    mask_row,
    row_label,
    with_adapter_ids,
)
from export.gate.references.loop import VariantSession
from service.core.fidelity import (
    FIDELITY_MIN_COSINE,
    FidelityReference,
    cosines,
)
from service.core.repository import ADAPTER_IDS, TASK_VECTORS
from service.pipeline.tokenizer import TextTokenizer

SERVED_LENGTH_BUCKET = 32
"""Served batches are padded to a multiple of this (the server's CUDA length bucket)."""
FIDELITY_ROWS = 6
"""Gate sentences stored for the server's check at load (plus one left-padded and one holed copy)."""
FIDELITY_MAX_TOKENS = 48
"""Longest sentence stored for the check at load: it runs at every load, on the CPU too (tens of ms)."""


def pad_to(feed: dict[str, np.ndarray], length: int, pad_token_id: int = 0) -> dict[str, np.ndarray]:
    """A batch padded on the right to `length` (masked positions), as the server's batcher pads."""
    rows, width = feed["input_ids"].shape
    padded = {}
    for name, array in feed.items():
        fill = pad_token_id if name == "input_ids" else 0
        padded[name] = np.concatenate([array, np.full((rows, length - width), fill, dtype=array.dtype)], axis=1)
    return padded


@torch.inference_mode()
def embed_each(model: nn.Module, feeds: list[dict[str, np.ndarray]]) -> np.ndarray:
    """The PyTorch model's answer for each feed (its embedding, or a classifier's logits), concatenated."""
    answers = []
    for feed in feeds:
        answer = model(**{name: torch.from_numpy(array) for name, array in feed.items()})
        answers.append((answer[1] if isinstance(answer, tuple) else answer).numpy())
    return np.concatenate(answers)


def served_feeds(
    tokenizer: TextTokenizer,
    items: list,
    input_names: list[str],
    *,
    max_length: int,
    pad_token_id: int,
    adapter_ids: list[int] | None = None,
) -> tuple[list[dict[str, np.ndarray]], list[dict[str, np.ndarray]]]:
    """Texts (or pairs) as the server feeds them: each alone, and in padded batches.

    Batches hold SENTENCE_BATCH rows padded on the right to a multiple of SERVED_LENGTH_BUCKET
    (never past max_length), as the server's batcher pads them. adapter_ids: each item's task
    adapter, every token of its row alike, as the server gives them (None: none).
    """

    def encoded_from(first: int, chunk: list) -> dict[str, np.ndarray]:
        feed = encode(tokenizer, chunk)
        if adapter_ids is not None:
            ids = np.array(adapter_ids[first : first + len(chunk)], dtype=np.int64)
            feed[ADAPTER_IDS] = np.repeat(ids[:, None], feed["input_ids"].shape[1], axis=1)
        return feed

    alone = [{name: encoded_from(i, [item])[name] for name in input_names} for i, item in enumerate(items)]
    batches = []
    for start in range(0, len(items), SENTENCE_BATCH):
        encoded = encoded_from(start, items[start : start + SENTENCE_BATCH])
        feed = {name: encoded[name] for name in input_names}
        width = feed["input_ids"].shape[1]
        bucketed = -(-width // SERVED_LENGTH_BUCKET) * SERVED_LENGTH_BUCKET
        batches.append(pad_to(feed, max(width, min(bucketed, max_length)), pad_token_id))
    return alone, batches


@dataclass(frozen=True)
class ServedFigures:
    """What a user of the server gets from one variant: texts in, `embedding` out, against the model."""

    provider: str
    min_cosine: float
    mean_cosine: float
    worst_sentence: str
    sentences: int

    def to_dict(self) -> dict[str, object]:
        """Figures for parity.json."""
        return {
            "provider": self.provider,
            "min_cosine": round(self.min_cosine, 8),
            "mean_cosine": round(self.mean_cosine, 8),
            "worst_sentence": self.worst_sentence,
            "sentences": self.sentences,
            "fidelity_rule": FIDELITY_MIN_COSINE,
            "meets_fidelity_rule": self.min_cosine >= FIDELITY_MIN_COSINE,
            "path": "server tokenizer configuration; each sentence alone and in batches of "
            f"{SENTENCE_BATCH} padded to a multiple of {SERVED_LENGTH_BUCKET}; embedding output",
        }


class ServedPath:
    """The gate sentences as the server would see them, and the model's embedding of each one.

    expected: the PyTorch model's embeddings of the sentences in order (the "sentences" cases'
    references: right-padded batches, where the mask makes padding exactly inert).
    """

    def __init__(
        self,
        expected: np.ndarray,
        input_names: list[str],
        tokenizer: TextTokenizer,
        sentences: list[str],
        *,
        max_length: int,
        pad_token_id: int,
    ) -> None:
        self.sentences = sentences
        self.expected = expected
        self.alone, self.batches = served_feeds(
            tokenizer,
            sentences,
            input_names,
            max_length=max_length,
            pad_token_id=pad_token_id,
            adapter_ids=[i % GATE_ADAPTER_IDS for i in range(len(sentences))],  # as the sentence cases have them
        )

    def measure(self, session: VariantSession) -> ServedFigures:
        """Run every sentence through a session both ways; the worst of the two counts for each sentence."""
        alone = np.concatenate([session.run(["embedding"], feed)[0] for feed in self.alone])
        batched = np.concatenate([session.run(["embedding"], feed)[0] for feed in self.batches])
        row_cosines = np.minimum(cosines(alone, self.expected), cosines(batched, self.expected))
        worst = int(np.argmin(row_cosines))
        return ServedFigures(
            provider=session.get_providers()[0],
            min_cosine=float(row_cosines[worst]),
            mean_cosine=float(row_cosines.mean()),
            worst_sentence=f"sentence {worst + 1}: {self.sentences[worst][:40]!r}",
            sentences=len(self.sentences),
        )


def fidelity_reference(
    model: nn.Module, input_names: list[str], tokenizer: TextTokenizer | None, sentences: list, max_length: int
) -> FidelityReference:
    """The few inputs the server checks each variant with at load, and the model's fp32 embeddings for them.

    With a tokenizer: gate sentences of up to FIDELITY_MAX_TOKENS tokens spread from the shortest
    to the longest (short inputs are where lower precisions are weakest), then a middle one again
    left-padded and the longest with a hole in its mask. Without one: random token rows with each
    mask shape.
    """
    if tokenizer is not None:
        lengths = {text: encode(tokenizer, [text])["input_ids"].shape[1] for text in sentences}
        short = [text for text in sentences if lengths[text] <= FIDELITY_MAX_TOKENS] or sentences
        by_length = sorted(short, key=lambda text: (lengths[text], text))
        step = (len(by_length) - 1) / max(1, FIDELITY_ROWS - 1)
        picks = list(dict.fromkeys(by_length[round(i * step)] for i in range(FIDELITY_ROWS)))
        feed = {name: array for name, array in encode(tokenizer, picks).items() if name in input_names}
        middle, last = len(picks) // 2, len(picks) - 1
        extra = [
            (
                {k: v[middle : middle + 1] for k, v in left_padded(feed).items()},
                f"{row_label(picks[middle])} left-padded",
            ),
            ({k: v[last:] for k, v in holed(feed).items()}, f"{row_label(picks[last])} holed"),
        ]
        rows = [({k: v[i : i + 1] for k, v in feed.items()}, row_label(text)) for i, text in enumerate(picks)]
        rows += extra
    else:
        rng = np.random.default_rng(0)
        length = min(16, max_length)
        rows = []
        for index, style in enumerate(("full", *MASK_STYLES, *MASK_STYLES)):
            real = length if style == "full" else int(rng.integers(1, length))
            mask = mask_row(length, real, style, rng)
            row = {
                "input_ids": rng.integers(1, model.config.vocab_size, size=(1, length), dtype=np.int64) * mask,
                "attention_mask": mask[None, :],
                "token_type_ids": np.zeros((1, length), dtype=np.int64),
            }
            label = f"tokens row {index} ({style}, {real} tokens)"
            rows.append(({name: row[name] for name in input_names if name != ADAPTER_IDS}, label))
    width = max(feed["input_ids"].shape[1] for feed, _ in rows)
    padded = [pad_to(feed, width, model.config.pad_token_id) for feed, _ in rows]
    batch = {name: np.concatenate([feed[name] for feed in padded]) for name in input_names if name != ADAPTER_IDS}
    batch = with_adapter_ids(batch, input_names)
    output = model.output_names[-1]  # embedding, logits, sparse_embedding or token_vectors

    output = next(name for name in model.output_names if name in TASK_VECTORS.values())  # embedding, logits, sparse
    return FidelityReference(batch, tuple(label for _, label in rows), embed_each(model, [batch]), output)
