"""The rows an ingestion embeds: texts from input files, or image files.

Texts, one a row: .txt (a line each), .jsonl (a field), .csv and .parquet (a column). Images, one a
row: a folder's image files, image files as given, or the paths in a field or column of a .jsonl, .csv
or .parquet file. Every row must hold a non-empty text, or name a non-empty file: a row that does not
is refused with an InputError naming the file and its line (its row, for Parquet), before anything is
sent.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

FORMATS = (".txt", ".jsonl", ".csv", ".parquet")
TABLE_FORMATS = (".jsonl", ".csv", ".parquet")
"""The input files that may list image paths (in a field or column)."""
IMAGE_FORMATS = (".png", ".jpg", ".jpeg", ".webp", ".gif")
"""The files a folder's images are (by suffix, in any case): what the server decodes."""
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

    def values(self) -> Iterator[tuple[str, object]]:
        """Every row's value (its line's, field's or column's), with where it is (a line, or a Parquet row)."""
        readers = {".txt": self._lines, ".jsonl": self._json_lines, ".csv": self._csv, ".parquet": self._parquet}
        return readers[self.path.suffix]()

    def texts(self) -> Iterator[str]:
        """Every row's text, in order; InputError at the first row that has none."""
        for where, text in self.values():
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


@dataclass(frozen=True)
class ImageFile:
    """One image to embed: its file, its size in bytes, and how messages name it."""

    path: Path
    size: int
    name: str


@dataclass(frozen=True)
class ImageInput:
    """Images to embed, one a row, in order.

    Each source a folder (its image files, every level, sorted by path) or an image file; or, with `column`, one
    .jsonl, .csv or .parquet source whose field or column holds each row's image path (a relative one from that
    file's folder).
    """

    sources: tuple[Path, ...]
    column: str | None = None

    def __post_init__(self) -> None:
        if not self.sources:
            raise InputError("no images: give a folder, image files, or a table of paths")
        if self.column is not None:
            if len(self.sources) != 1 or self.sources[0].suffix not in TABLE_FORMATS:
                raise InputError(f"a column of image paths is read from one {', '.join(TABLE_FORMATS)} file")
            InputFile(self.sources[0], self.column, self.column)  # refused here if it is not one
            return
        for source in self.sources:
            if not source.is_dir() and source.suffix.lower() not in IMAGE_FORMATS:
                what = "no such file or folder" if not source.exists() else "not a folder or an image file"
                raise InputError(f"{source}: {what} ({', '.join(IMAGE_FORMATS)}; a table of paths needs a column)")

    def images(self) -> Iterator[ImageFile]:
        """Every row's image, in order, each a non-empty file; InputError at the first row that is not."""
        if self.column is not None:
            table = self.sources[0]
            for where, value in InputFile(table, self.column, self.column).values():
                if not isinstance(value, str) or not value:
                    raise InputError(f"{table}:{where}: {self.column!r} holds no image path ({value!r})")
                yield _image_file(table.parent / value, f"{table}:{where} ({value})")
            return
        for source in self.sources:
            if source.is_dir():
                found = (path for path in source.rglob("*") if path.suffix.lower() in IMAGE_FORMATS)
                for path in sorted(found):
                    if path.is_file():
                        yield _image_file(path, str(path))
            else:
                yield _image_file(source, str(source))

    def checked(self) -> tuple[int, str]:
        """The number of images, every one checked, and a digest of what they are (paths, sizes, times)."""
        digest = hashlib.sha256()
        count = 0
        for image in self.images():
            count += 1
            stat = image.path.stat()
            digest.update(f"{image.path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
        return count, digest.hexdigest()

    def describe(self) -> str:
        """The sources, for the checkpoint's identity."""
        resolved = [str(source.resolve()) for source in self.sources]
        return json.dumps(resolved if self.column is None else {"table": resolved[0], "column": self.column})


def _image_file(path: Path, name: str) -> ImageFile:
    try:
        size = os.stat(path).st_size
    except OSError as error:
        raise InputError(f"{name}: {error.strerror}") from None
    if not path.is_file():
        raise InputError(f"{name}: not a file")
    if size == 0:
        raise InputError(f"{name}: empty file (every image needs its bytes)")
    return ImageFile(path, size, name)


def image_sources(paths: Sequence[Path]) -> bool:
    """Whether command-line inputs are images (a folder, or image files) rather than one file of texts."""
    return any(path.is_dir() or path.suffix.lower() in IMAGE_FORMATS for path in paths)
