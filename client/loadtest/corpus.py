"""The texts shipped with the load generator: `short.txt` sentences and `long.txt` passages."""

from __future__ import annotations

import functools
from importlib import resources

from client.loadtest.config import CORPORA


@functools.cache
def load_corpus(name: str) -> tuple[str, ...]:
    """The non-empty lines of a shipped corpus (`short` or `long`)."""
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; known: {', '.join(CORPORA)}")
    text = resources.files("client.loadtest").joinpath(f"{name}.txt").read_text(encoding="utf-8")
    return tuple(line.strip() for line in text.splitlines() if line.strip())
