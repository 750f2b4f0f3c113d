"""The parity gate's cases: what is fed to both the PyTorch model and every ONNX variant.

Random token batches (sizes x lengths; each padded row right-padded, left-padded or with holes in its
mask, in turn), real sentences through the model's tokenizer, and the same sentences left-padded and
with a hole in the middle of each mask (kind "sentence_masks"): the codec accepts any 0/1 mask, so
every graph must honour any of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from service.core.repository import ADAPTER_IDS
from service.pipeline.tokenizer import TextTokenizer

BATCH_SIZES = (1, 2, 7, 32)
SENTENCE_BATCH = 16
SENTENCES_FILE = Path(__file__).resolve().parents[1] / "data" / "sentences.txt"
MASK_STYLES = ("right-padded", "left-padded", "holed")
HOLE_TOKENS = 2
"""Positions masked out in the middle of each sentence for the holed cases."""


@dataclass(frozen=True)
class Case:
    """One batch fed to both models; labels name each row for failure messages."""

    kind: str
    name: str
    feed: dict[str, np.ndarray]
    row_labels: tuple[str, ...]


def mask_row(length: int, real: int, style: str, rng: np.random.Generator) -> np.ndarray:
    """A 0/1 mask of `length` with `real` ones: at the start, at the end, or scattered (first kept)."""
    row = np.zeros(length, dtype=np.int64)
    if style == "right-padded":
        row[:real] = 1
    elif style == "left-padded":
        row[length - real :] = 1
    else:
        row[0] = 1
        row[1 + rng.choice(length - 1, size=real - 1, replace=False)] = 1
    return row


GATE_ADAPTER_IDS = 6
"""Adapter ids the gate's rows cycle through on a model with task adapters: none, then jina-embeddings-v3's five
(an id past a model's tasks selects none, as 0 does)."""
CASE_TOKENS = 8192
"""The most tokens one random-token gate batch holds (32 rows of 256; one row of 8,192)."""


def token_cases(input_names: list[str], vocab_size: int, max_length: int, seed: int = 0) -> list[Case]:
    """Random token batches of sizes {1, 2, 7, 32} and lengths {1, 5, 64, max}, with every mask shape.

    The first row of each batch is full length so the padded width is exercised; the others get
    random lengths, padded on the right, on the left or with holes in the mask, in turn. A batch
    holds at most CASE_TOKENS tokens (fewer rows at long lengths): attention's scores grow with the
    square of the length, and 32 rows of 8,192 tokens would take about 100 GB.
    """
    rng = np.random.default_rng(seed)
    lengths = sorted({min(length, max_length) for length in (1, 5, 64, max_length)})
    cases = []
    seen = set()
    for size in BATCH_SIZES:
        for length in lengths:
            batch = max(1, min(size, CASE_TOKENS // length))
            if (batch, length) in seen:
                continue
            seen.add((batch, length))
            row_lengths = rng.integers(1, length + 1, size=batch)
            row_lengths[0] = length
            styles = ["full"] + [MASK_STYLES[row % len(MASK_STYLES)] for row in range(batch - 1)]
            mask = np.stack([mask_row(length, n, style, rng) for n, style in zip(row_lengths, styles, strict=True)])
            ids = rng.integers(1, vocab_size, size=(batch, length), dtype=np.int64) * mask
            feed = {
                "input_ids": ids,
                "attention_mask": mask,
                "token_type_ids": rng.integers(0, 2, size=(batch, length), dtype=np.int64) * mask,
            }
            feed = with_adapter_ids(feed, input_names, first=len(cases))
            name = f"tokens {batch}x{length}"
            labels = tuple(
                f"{name} row {row} ({style}, {n} tokens)"
                for row, (n, style) in enumerate(zip(row_lengths, styles, strict=True))
            )
            cases.append(Case("tokens", name, {k: feed[k] for k in input_names}, labels))
    return cases


def with_adapter_ids(feed: dict[str, np.ndarray], input_names: list[str], first: int = 0) -> dict[str, np.ndarray]:
    """The feed with adapter_ids where the graph takes them: each task's adapter (and none) on some of its rows.

    Row i's every token takes id (first + i) mod GATE_ADAPTER_IDS.
    """
    if ADAPTER_IDS not in input_names:
        return feed
    rows, length = feed["input_ids"].shape
    ids = (first + np.arange(rows, dtype=np.int64)) % GATE_ADAPTER_IDS
    return feed | {ADAPTER_IDS: np.repeat(ids[:, None], length, axis=1)}


def sentence_pairs(sentences: list[str]) -> list[tuple[str, str]]:
    """Each sentence with the next one (the last with the first): a classifier's gate inputs."""
    return [(text, sentences[(i + 1) % len(sentences)]) for i, text in enumerate(sentences)]


def encode(tokenizer: TextTokenizer, chunk: list) -> dict[str, np.ndarray]:
    """A padded batch of texts, or of pairs as the model's tokenizer pairs them."""
    batch = tokenizer.encode_pairs(chunk) if isinstance(chunk[0], tuple) else tokenizer.encode(chunk)
    return batch.feed(("input_ids", "attention_mask", "token_type_ids", ADAPTER_IDS))


def row_label(item: str | tuple[str, str]) -> str:
    """A row's name in failure messages: its text (a pair's first text), cut to 40 characters."""
    return repr(item[0][:40]) if isinstance(item, tuple) else repr(item[:40])


def sentence_cases(input_names: list[str], tokenizer: TextTokenizer, sentences: list) -> list[Case]:
    """Real sentences (or pairs of them) through the model's tokenizer, in batches padded to their longest."""
    cases = []
    for start in range(0, len(sentences), SENTENCE_BATCH):
        chunk = sentences[start : start + SENTENCE_BATCH]
        feed = with_adapter_ids(encode(tokenizer, chunk), input_names, first=start)
        labels = tuple(f"sentence {start + i + 1}: {row_label(text)}" for i, text in enumerate(chunk))
        cases.append(
            Case("sentences", f"sentences {start + 1}-{start + len(chunk)}", {k: feed[k] for k in input_names}, labels)
        )
    return cases


def left_padded(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A right-padded batch with each row's tokens moved to the end (padding first)."""
    length = feed["input_ids"].shape[1]
    moved = {name: np.zeros_like(array) for name, array in feed.items()}
    for row, real in enumerate(feed["attention_mask"].sum(axis=1)):
        for name, array in feed.items():
            moved[name][row, length - real :] = array[row, :real]
    return moved


def holed(feed: dict[str, np.ndarray], hole: int = HOLE_TOKENS) -> dict[str, np.ndarray]:
    """A right-padded batch with up to `hole` positions masked out in the middle of each row (ids kept).

    Rows keep their width (a row at the model's maximum length stays valid); the masked tokens
    keep their ids, so a graph that let them leak into the result would show it.
    """
    spread = {name: array.copy() for name, array in feed.items()}
    for row, real in enumerate(feed["attention_mask"].sum(axis=1)):
        middle = max(1, int(real) // 2)
        spread["attention_mask"][row, middle : min(middle + hole, int(real) - 1)] = 0
    return spread


def sentence_mask_cases(input_names: list[str], tokenizer: TextTokenizer, sentences: list) -> list[Case]:
    """The sentence batches again, left-padded and with a hole in each row's mask (rows of 3+ tokens)."""
    cases = []
    for start in range(0, len(sentences), SENTENCE_BATCH):
        chunk = sentences[start : start + SENTENCE_BATCH]
        feed = with_adapter_ids(encode(tokenizer, chunk), input_names, first=start)
        feed = {name: array for name, array in feed.items() if name in input_names}
        for style, reshaped in (("left-padded", left_padded(feed)), ("holed", holed(feed))):
            labels = tuple(f"sentence {start + i + 1} {style}: {row_label(text)}" for i, text in enumerate(chunk))
            name = f"sentences {start + 1}-{start + len(chunk)} {style}"
            cases.append(Case("sentence_masks", name, reshaped, labels))
    return cases


def read_sentences(path: Path = SENTENCES_FILE) -> list[str]:
    """Non-empty lines of a sentence file."""
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
