"""The load generator's texts: `short.txt` sentences, `long.txt` passages, and `chunks` cut from them."""

from __future__ import annotations

import functools
import random
from importlib import resources

from tools.loadtest.config import CORPORA

CHUNK_WORDS = (8, 240)
"""Shortest and longest chunk, in words: the spread of the chunks a document splitter sends for ingestion."""
CHUNK_COUNT = 512
CHUNK_SEED = 16


@functools.cache
def load_corpus(name: str) -> tuple[str, ...]:
    """The texts of a corpus: the non-empty lines of a shipped file, or the generated `chunks`."""
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; known: {', '.join(CORPORA)}")
    if name == "chunks":
        return _chunks()
    text = resources.files("tools.loadtest").joinpath(f"{name}.txt").read_text(encoding="utf-8")
    return tuple(line.strip() for line in text.splitlines() if line.strip())


def _chunks() -> tuple[str, ...]:
    """CHUNK_COUNT runs of consecutive words of `long`, their lengths uniform in CHUNK_WORDS (always the same)."""
    words = " ".join(load_corpus("long")).split()
    rng = random.Random(CHUNK_SEED)
    chunks = []
    for _ in range(CHUNK_COUNT):
        size = rng.randint(*CHUNK_WORDS)
        start = rng.randrange(len(words) - size)
        chunks.append(" ".join(words[start : start + size]))
    return tuple(chunks)
