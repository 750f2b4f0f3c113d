"""The export cache: each model exported once, into an entry written whole or not at all, shared under a lock.

    DIR/<name>-<key>/<name>/...          an entry: a model repository holding the one model
    DIR/<name>-<key>/entry.json          what the key was made of (source, commit or digest, exporter, options)
    DIR/.locks/<name>-<key>.lock         flock(2) of the process exporting that entry, its pid inside
    DIR/.partial-<name>-<key>-<pid>/     an export in progress (removed on failure, renamed into place when gated)

The key is a digest of what determines the result: the source's resolved commit (or, for a folder,
export.sources.folder_digest), the exporter's own files, the versions of the libraries it runs, the
name, variants and options. An entry is renamed into place only after the gate passed and the model
was published into it, so a crash leaves at most a `.partial-*` folder, which the next holder of
the lock removes. The lock is flock(2): the kernel releases it when its process dies, however it
dies, so a dead exporter's lock is simply taken by the next one; a second process asking for the
same entry waits for it, then serves what the first exported.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

log = logging.getLogger(__name__)

ENTRY_FILE = "entry.json"
LOCKS_FOLDER = ".locks"
PARTIAL_PREFIX = ".partial-"
KEY_CHARS = 16
"""Hex digits of the key in an entry's name."""
LIBRARIES = ("torch", "onnx", "onnxruntime", "onnxruntime-gpu", "sentence-transformers", "transformers")
"""Libraries whose version may change what is exported or how it is gated."""
EXPORTER_FOLDER = Path(__file__).resolve().parent


def exporter_version() -> str:
    """A digest of the exporter's own files (code and data) and the versions of the libraries it runs."""
    digest = hashlib.sha256()
    for path in sorted(EXPORTER_FOLDER.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(path.relative_to(EXPORTER_FOLDER).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    for library in LIBRARIES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            digest.update(f"{library}=={metadata.version(library)}\0".encode())
    return digest.hexdigest()[:KEY_CHARS]


@dataclass(frozen=True)
class CacheKey:
    """What determines an export's result; its digest names the entry."""

    name: str
    source: str
    """org/name@commit, or a folder."""
    content: str
    """The resolved commit, or the folder's digest."""
    exporter: str
    options: dict[str, object]

    @property
    def digest(self) -> str:
        """The key's digest (its first KEY_CHARS hex digits)."""
        fields = {"name": self.name, "content": self.content, "exporter": self.exporter, "options": self.options}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:KEY_CHARS]

    @property
    def entry_name(self) -> str:
        """The entry's folder name: `<name>-<digest>`."""
        return f"{self.name}-{self.digest}"


class ExportCache:
    """A cache folder of exported models (see the module's docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def entry(self, key: CacheKey) -> Path:
        """Where the key's entry is (or will be)."""
        return self.root / key.entry_name

    def model_folder(self, key: CacheKey) -> Path:
        """The model's folder inside the key's entry."""
        return self.entry(key) / key.name

    def holds(self, key: CacheKey) -> bool:
        """Whether the key's entry is complete (entries are renamed into place whole: present means complete)."""
        return (self.entry(key) / ENTRY_FILE).is_file()

    @contextlib.contextmanager
    def lock(self, key: CacheKey, say: Callable[[str], None] = log.info) -> Iterator[None]:
        """Hold the key's lock (waiting, and saying so, while another process holds it); stale partials go."""
        locks = self.root / LOCKS_FOLDER
        locks.mkdir(parents=True, exist_ok=True)
        path = locks / f"{key.entry_name}.lock"
        with path.open("a+") as lock_file:
            try:
                fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock_file.seek(0)
                holder = lock_file.read().strip() or "another process"
                say(f"waiting for {holder}, which is exporting {key.entry_name} into {self.root}")
                fcntl.flock(lock_file, fcntl.LOCK_EX)
            lock_file.seek(0)
            lock_file.truncate()
            lock_file.write(f"pid {os.getpid()} on {os.uname().nodename}\n")
            lock_file.flush()
            try:
                self._remove_partials(key)
                yield
            finally:
                lock_file.truncate(0)
                fcntl.flock(lock_file, fcntl.LOCK_UN)

    def _remove_partials(self, key: CacheKey) -> None:
        """Partial entries of this key: left by a process that died (the lock is ours, so none is in progress)."""
        for partial in self.root.glob(f"{PARTIAL_PREFIX}{key.entry_name}-*"):
            log.warning("removing %s, left by an export that did not finish", partial)
            shutil.rmtree(partial, ignore_errors=True)

    @contextlib.contextmanager
    def writing(self, key: CacheKey) -> Iterator[Path]:
        """A partial entry to export into (a repository folder); renamed into place if the block ends normally.

        Call with the key's lock held. Whatever the block raises, the partial entry is removed.
        """
        partial = self.root / f"{PARTIAL_PREFIX}{key.entry_name}-{os.getpid()}"
        partial.mkdir(parents=True)
        try:
            yield partial
            record = {
                "name": key.name,
                "source": key.source,
                "content": key.content,
                "exporter": key.exporter,
                "options": key.options,
            }
            (partial / ENTRY_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
            _sync_tree(partial)
            partial.rename(self.entry(key))
            _sync_folder(self.root)
        finally:
            shutil.rmtree(partial, ignore_errors=True)


def _sync_tree(folder: Path) -> None:
    """Flush every file and folder under folder: the rename that publishes it must not outrun its content."""
    for path in sorted(folder.rglob("*"), reverse=True):
        if path.is_file():
            with path.open("rb") as file:
                os.fsync(file.fileno())
    for path in [*sorted(p for p in folder.rglob("*") if p.is_dir()), folder]:
        _sync_folder(path)


def _sync_folder(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
