"""A model's source made a local folder: a Hugging Face repository through huggingface_hub, or a folder as it is.

huggingface_hub does the resolving and downloading, so HF_HOME / HF_HUB_CACHE, HF_TOKEN, HF_ENDPOINT and
HF_HUB_OFFLINE mean what they mean everywhere else; only the files the exporter reads are downloaded
(HUB_FILES; PyTorch's pickles only where a folder has no safetensors). The resolved commit is recorded.
Every failure is a SourceError whose message is the one line a user needs. Torch-free: a cache hit
(export.cache) resolves its source without loading the exporter.
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from service.core.sources import Source

log = logging.getLogger(__name__)

HUB_FILES = ("*.json", "*.txt", "*.safetensors", "*.pt")
"""What the exporter and the reference libraries read from a folder: configurations, tokenizer files, weights in
safetensors (the model's and its modules'), bge-m3's head files. ONNX, OpenVINO and other formats stay on the Hub."""
PYTORCH_WEIGHTS = ("pytorch_model.bin", "*/pytorch_model.bin")
"""Downloaded only when the repository's top level has no model.safetensors."""
NETWORK_ATTEMPTS = 3
"""Tries at reaching the Hub before a network failure is final."""
RETRY_DELAY_S = 1.0
"""Delay before the second try; doubled before each later one."""


class UnusableSource(ValueError):
    """A source that cannot be exported (its folder, its configuration, its download): one line for the user."""


class SourceError(UnusableSource):
    """A source that cannot be made a folder: the message names the source, and what to do where it can."""


@dataclass(frozen=True)
class ResolvedSource:
    """A source as a local folder, with what identifies its content."""

    source: Source
    folder: Path
    commit: str = ""
    """The Hugging Face commit the folder is a snapshot of ("" for a local folder)."""

    def describe(self) -> str:
        """`org/name@commit`, or the folder."""
        return f"{self.source.repo_id}@{self.commit}" if self.commit else str(self.folder)


def exporter_files(folder: Path) -> list[Path]:
    """The files of a folder the exporter reads (HUB_FILES, PyTorch pickles), by relative path."""
    patterns = HUB_FILES + PYTORCH_WEIGHTS
    found = []
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder).as_posix()
        if path.is_file() and any(fnmatch.fnmatch(relative, pattern) for pattern in patterns):
            found.append(path)
    return found


def folder_digest(folder: Path) -> str:
    """sha256 over the names and contents of the files the exporter reads: a folder's identity in the cache key."""
    digest = hashlib.sha256()
    for path in exporter_files(folder):
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0")
        with path.open("rb") as file:
            while chunk := file.read(1 << 20):
                digest.update(chunk)
        digest.update(b"\0")
    return digest.hexdigest()


def resolve(source: Source, say: Callable[[str], None] = log.info) -> ResolvedSource:
    """The source as a local folder (downloading what the exporter reads); SourceError with one line otherwise."""
    if not source.on_hub:
        if not source.folder.is_dir():
            raise SourceError(f"{source.text}: not a directory, nor a Hugging Face id (org/name[@REVISION])")
        return ResolvedSource(source, source.folder.resolve())
    from huggingface_hub import constants  # noqa: PLC0415 - reads HF_* when asked, not when this module is imported

    attempt = 1
    while True:
        try:
            return _download(source, say)
        except SourceError as error:
            if not isinstance(error.__cause__, _NetworkFailure) or attempt >= NETWORK_ATTEMPTS:
                raise
            delay = RETRY_DELAY_S * 2 ** (attempt - 1)
            say(
                f"{source.repo_id}: the Hub at {constants.ENDPOINT} did not answer ({error.__cause__});"
                f" trying again in {delay:g} s"
            )
            time.sleep(delay)
            attempt += 1


class _NetworkFailure(Exception):
    """The Hub could not be reached (worth another try)."""


def _download(source: Source, say: Callable[[str], None]) -> ResolvedSource:
    """One try at snapshot_download, its failures as SourceError (caused by _NetworkFailure when worth a retry)."""
    from huggingface_hub import constants, snapshot_download  # noqa: PLC0415
    from huggingface_hub.errors import (  # noqa: PLC0415
        GatedRepoError,
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo, revision = source.repo_id, source.revision or None
    asked = f"{repo}@{revision}" if revision else repo
    cache, endpoint = constants.HF_HUB_CACHE, constants.ENDPOINT
    offline = constants.HF_HUB_OFFLINE
    say(f"resolving {asked} ({'offline, ' if offline else ''}Hugging Face cache {cache})")
    try:
        folder = Path(snapshot_download(repo, revision=revision, allow_patterns=list(HUB_FILES)))
        if not (folder / "model.safetensors").is_file():
            folder = Path(snapshot_download(repo, revision=revision, allow_patterns=list(PYTORCH_WEIGHTS)))
    except RevisionNotFoundError as error:
        raise SourceError(f"{repo}: no revision {revision!r} (branch, tag or commit) on {endpoint}") from error
    except GatedRepoError as error:
        raise SourceError(
            f"{repo} is gated: accept its terms on the Hub, then give a token that may read it (HF_TOKEN)"
        ) from error
    except RepositoryNotFoundError as error:
        token = "HF_TOKEN cannot read it" if _token_set() else "HF_TOKEN is not set"
        raise SourceError(f"{repo}: no such repository on {endpoint}, or it is private and {token}") from error
    except IncompleteSnapshotError as error:
        raise SourceError(f"{asked}: the snapshot in {cache} is incomplete and the Hub cannot complete it") from error
    except LocalEntryNotFoundError as error:
        if offline:
            raise SourceError(f"{asked}: not in the Hugging Face cache {cache}, and HF_HUB_OFFLINE is set") from error
        cause = error.__cause__ or error
        raise SourceError(
            f"{asked}: the Hub at {endpoint} cannot be reached ({type(cause).__name__}) after {NETWORK_ATTEMPTS}"
            f" tries, and {cache} does not hold it"
        ) from _NetworkFailure(type(cause).__name__)
    except HfHubHTTPError as error:
        status = error.response.status_code if error.response is not None else "?"
        if status == 401:
            token = "HF_TOKEN cannot read it" if _token_set() else "HF_TOKEN is not set"
            raise SourceError(f"{repo}: the Hub refused access (401): {token}") from error
        raise SourceError(f"{asked}: the Hub at {endpoint} answered {status}") from _NetworkFailure(str(status))
    except OSError as error:
        raise SourceError(f"{asked}: cannot download into {cache}: {error}") from error
    say(f"resolved {asked} to commit {folder.name} ({folder})")
    return ResolvedSource(source, folder, commit=folder.name)


def _token_set() -> bool:
    from huggingface_hub import get_token  # noqa: PLC0415

    return bool(get_token())
