"""Exported test models shared across pytest runs: one content-keyed folder per export under .test-cache/exports/.

A session fixture that exports a model asks `cached_export(name, inputs, build, made_by)`. The key
digests what determines the export: `inputs` (what the fixture makes the model from), the source of
`build`, the files of `made_by` (the test helpers it calls to make the source folders, a model folder it
starts from), the exporter's sources (export/ and the parts of service/ and protocol/ it imports) and the
versions of the libraries that build and check it. The first run builds into a temporary sibling folder
and renames it into place, so a folder found there is complete; later runs (the other passes of
`make test`, the next run on a dev machine) reuse it.
`make test` starts with `rm -rf .test-cache`, so CI exports each model once per run.

A cached folder is shared: tests read it and copy it before changing anything. Paths an export records
(parity.json's source) name the temporary folder it was built in.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import os
import shutil
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path

from tests.servers import ROOT

EXPORTS = ROOT / ".test-cache" / "exports"
EXPORTER_SOURCES = ("export", "protocol", "service/core", "service/pipeline", "service/errors.py")
"""What the exporter runs (export/ imports service.core, service.pipeline, service.errors and protocol)."""
LIBRARIES = ("torch", "transformers", "sentence_transformers", "tokenizers", "safetensors", "onnx", "onnxruntime")
"""The libraries whose versions decide an export: they build, convert and check it."""


def _files_digest(paths: tuple[Path, ...]) -> str:
    """A digest of every file under `paths` (files or folders), by name and content."""
    digest = hashlib.sha256()
    for path in paths:
        files = sorted(path.rglob("*")) if path.is_dir() else [path]
        for file in files:
            if file.is_file() and "__pycache__" not in file.parts:
                name = path.name / file.relative_to(path) if path.is_dir() else Path(path.name)
                digest.update(name.as_posix().encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


@cache
def exporter_digest() -> str:
    """A digest of the exporter's sources, the interpreter and the LIBRARIES' versions."""
    versions = [f"{name}=={importlib.import_module(name).__version__}" for name in LIBRARIES]
    sources = _files_digest(tuple(ROOT / path for path in EXPORTER_SOURCES))
    return hashlib.sha256("\n".join([sys.executable, *versions, sources]).encode()).hexdigest()


def export_key(inputs: object, build: Callable[[Path], None], made_by: tuple[Path, ...] = ()) -> str:
    """The cache key of an export made from `inputs` (JSON, or anything with a stable repr) by `build` and the
    `made_by` files."""
    described = json.dumps(inputs, sort_keys=True, default=repr)
    parts = [described, inspect.getsource(build), _files_digest(made_by), exporter_digest()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def cached_export(name: str, inputs: object, build: Callable[[Path], None], made_by: tuple[Path, ...] = ()) -> Path:
    """The folder `build` fills for this key, built once: into a temporary folder renamed into place.

    `build(folder)` fills an empty folder. When two runs build the same key at once, the first rename
    wins and the other run's folder is dropped.
    """
    target = EXPORTS / f"{name}-{export_key(inputs, build, made_by)}"
    if target.is_dir():
        return target
    building = EXPORTS / f".{target.name}.{os.getpid()}.building"
    shutil.rmtree(building, ignore_errors=True)
    building.mkdir(parents=True)
    try:
        build(building)
        building.rename(target)
    except OSError:
        if not target.is_dir():
            raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return target
