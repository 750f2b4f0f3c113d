"""An ingestion's output while it runs, and the record of its finished rows, so a later run does only the rest.

Beside OUTPUT: `OUTPUT.partial.npy`, the vectors written in place (a memory map, one row per input
row), and `OUTPUT.checkpoint.json`, the ranges of rows whose vectors are in it, written after the
map is flushed (so it never names a row that is not there), atomically (a new file renamed over the
old one). A run killed at any moment leaves a checkpoint naming only rows already written.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that does not belong to this input, model or output."""


@dataclass
class Ranges:
    """Sorted, disjoint half-open ranges [start, end) of row numbers."""

    spans: list[list[int]] = field(default_factory=list)

    def add(self, start: int, end: int) -> None:
        """Mark rows start..end-1, merging with the neighbours."""
        merged = []
        for low, high in self.spans:
            if high < start or low > end:
                merged.append([low, high])
            else:
                start, end = min(low, start), max(high, end)
        merged.append([start, end])
        self.spans = sorted(merged)

    def add_rows(self, rows: np.ndarray) -> None:
        """Mark each row of a sorted array, run by run."""
        breaks = np.flatnonzero(np.diff(rows) != 1) + 1
        for run in np.split(rows, breaks):
            self.add(int(run[0]), int(run[-1]) + 1)

    def __contains__(self, row: int) -> bool:
        return any(low <= row < high for low, high in self.spans)

    @property
    def count(self) -> int:
        """Rows marked."""
        return sum(high - low for low, high in self.spans)


class Checkpoint:
    """The partial output of an ingestion and its finished ranges; `identity` says what it is the output of."""

    def __init__(self, output: Path, identity: dict[str, object], rows: int, width: int, resume: bool) -> None:
        self.output = output
        self.partial = output.with_name(output.name + ".partial.npy")
        self.record = output.with_name(output.name + ".checkpoint.json")
        self.identity = identity
        self.finished = Ranges()
        if resume and self.record.is_file() and self.partial.is_file():
            saved = json.loads(self.record.read_text())
            if saved.get("version") != VERSION or saved.get("identity") != identity:
                raise CheckpointError(
                    f"{self.record} belongs to another run ({saved.get('identity')}); delete it or leave out --resume"
                )
            self.finished = Ranges(saved["finished"])
            self.vectors = np.lib.format.open_memmap(self.partial, mode="r+")
        else:
            output.parent.mkdir(parents=True, exist_ok=True)
            self.vectors = np.lib.format.open_memmap(self.partial, mode="w+", dtype=np.float32, shape=(rows, width))
            self.save()
        if self.vectors.shape != (rows, width):
            raise CheckpointError(f"{self.partial} holds {self.vectors.shape}, this run needs {(rows, width)}")

    def write(self, rows: np.ndarray, vectors: np.ndarray) -> None:
        """Put the vectors of these rows (sorted row numbers) in place and mark them finished."""
        self.vectors[rows] = vectors
        self.finished.add_rows(rows)

    def save(self) -> None:
        """Flush the vectors, then record the finished ranges (atomically)."""
        self.vectors.flush()
        fresh = self.record.with_name(self.record.name + ".new")
        fresh.write_text(json.dumps({"version": VERSION, "identity": self.identity, "finished": self.finished.spans}))
        os.replace(fresh, self.record)

    def complete(self) -> bool:
        """Whether every row is finished."""
        return self.finished.spans == [[0, len(self.vectors)]]

    def discard(self) -> None:
        """Remove the partial output and the record (after the final output is written)."""
        del self.vectors
        self.partial.unlink(missing_ok=True)
        self.record.unlink(missing_ok=True)
