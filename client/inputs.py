"""Texts from input files, one a row: .txt (a line each), .jsonl (a field), .csv and .parquet (a column).

Every row must hold a non-empty text: a row that does not is refused with an InputError naming the
file and its line (its row, for Parquet), before anything is sent.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

FORMATS = (".txt", ".jsonl", ".csv", ".parquet")
DEFAULT_FIELD = "text"
PARQUET_BATCH_ROWS = 8192


class InputError(ValueError):
    """An input file that cannot be read as texts; the message names the file and the line."""


@dataclass(frozen=True)
class InputFile:
    """A file of texts and where its text is: `field` of each JSON line, `column` of a CSV or Parquet file."""

    path: Path
    field: str = DEFAULT_FIELD
    column: str = DEFAULT_FIELD

    def __post_init__(self) -> None:
        if self.path.suffix not in FORMATS:
            raise InputError(f"{self.path}: unknown input format {self.path.suffix!r} (one of {', '.join(FORMATS)})")
        if not self.path.is_file():
            raise InputError(f"{self.path}: no such file")

    def texts(self) -> Iterator[str]:
        """Every row's text, in order; InputError at the first row that has none."""
        readers = {".txt": self._lines, ".jsonl": self._json_lines, ".csv": self._csv, ".parquet": self._parquet}
        for where, text in readers[self.path.suffix]():
            if not isinstance(text, str):
                raise InputError(f"{self.path}:{where}: the text is {type(text).__name__}, not a string")
            if not text.strip():
                raise InputError(f"{self.path}:{where}: empty text (every row needs one to embed)")
            yield text

    def count(self) -> int:
        """The number of rows, every one checked."""
        return sum(1 for _ in self.texts())

    def _lines(self) -> Iterator[tuple[str, object]]:
        with self.path.open("rb") as lines:
            for number, raw in enumerate(lines, start=1):
                yield f"{number}", _decoded(raw, self.path, number).removesuffix("\n").removesuffix("\r")

    def _json_lines(self) -> Iterator[tuple[str, object]]:
        with self.path.open("rb") as lines:
            for number, raw in enumerate(lines, start=1):
                line = _decoded(raw, self.path, number)
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise InputError(f"{self.path}:{number}: not JSON: {error.msg} (column {error.colno})") from None
                if not isinstance(record, dict) or self.field not in record:
                    raise InputError(f"{self.path}:{number}: not a JSON object with a {self.field!r} field")
                yield f"{number}", record[self.field]

    def _csv(self) -> Iterator[tuple[str, object]]:
        with self.path.open(newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            if reader.fieldnames is None or self.column not in reader.fieldnames:
                raise InputError(f"{self.path}:1: no column {self.column!r} (columns: {reader.fieldnames})")
            try:
                for record in reader:
                    yield f"{reader.line_num}", record[self.column]
            except (UnicodeDecodeError, csv.Error) as error:
                raise InputError(f"{self.path}:{reader.line_num + 1}: {error}") from None

    def _parquet(self) -> Iterator[tuple[str, object]]:
        try:
            import pyarrow.parquet as pq  # noqa: PLC0415 (the optional extra: encoder-serve[parquet])
        except ImportError:
            raise InputError(
                f"{self.path}: reading Parquet needs pyarrow: pip install 'encoder-serve[parquet]'"
            ) from None
        table = pq.ParquetFile(self.path)
        if self.column not in table.schema_arrow.names:
            raise InputError(f"{self.path}: no column {self.column!r} (columns: {table.schema_arrow.names})")
        row = 0
        for batch in table.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[self.column]):
            for text in batch.column(0).to_pylist():
                row += 1
                yield f"row {row}", text


def _decoded(raw: bytes, path: Path, number: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InputError(f"{path}:{number}: not UTF-8 ({error.reason} at byte {error.start})") from None
