"""What `--model [NAME=]SOURCE` and `python -m export --source SOURCE` name: a Hugging Face id or a folder.

    org/name, org/name@REVISION, hf://org/name[@REVISION]   a Hugging Face repository (branch, tag or commit)
    /mnt/models, ./my-model                                 a local folder (a folder that exists wins)

Only the text is read here (the server names its models with it and never imports the exporter);
export.sources resolves a source with huggingface_hub.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

HUB_SCHEME = "hf://"
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")
_SERVED_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*$")


class SourceSyntaxError(ValueError):
    """A SOURCE (or NAME=SOURCE) that is neither a folder nor a Hugging Face id; the message says which text."""


@dataclass(frozen=True)
class Source:
    """A model's source: a Hugging Face repository at a revision, or a local folder."""

    text: str
    """As given."""
    repo_id: str = ""
    """org/name; "" for a folder."""
    revision: str = ""
    """Branch, tag or commit asked for ("" = the repository's default branch, main)."""
    folder: Path | None = None
    """The local folder; None for a Hugging Face id."""

    @property
    def on_hub(self) -> bool:
        """Whether this names a Hugging Face repository."""
        return self.folder is None

    @property
    def default_name(self) -> str:
        """The served name when none is given: the id's last part, or the folder's name."""
        return self.repo_id.rsplit("/", 1)[-1] if self.on_hub else self.folder.resolve().name


def parse_source(text: str) -> Source:
    """Read a SOURCE: hf://org/name[@rev], an existing folder, org/name[@rev], or a path (SourceSyntaxError)."""
    text = text.strip()
    if not text:
        raise SourceSyntaxError("empty model source")
    hub_text = text.removeprefix(HUB_SCHEME)
    if text.startswith(HUB_SCHEME) or not Path(text).expanduser().is_dir():
        match = _HUB_ID.match(hub_text)
        if match is not None:
            return Source(text, repo_id=match["repo"], revision=match["revision"] or "")
        if text.startswith(HUB_SCHEME):
            raise SourceSyntaxError(f"{text!r} is not a Hugging Face id (hf://org/name or hf://org/name@REVISION)")
    return Source(text, folder=Path(text).expanduser())


@dataclass(frozen=True)
class NamedSource:
    """One `--model`: the name it is served under and its source."""

    name: str
    source: Source


def parse_model_argument(text: str) -> NamedSource:
    """Read `[NAME=]SOURCE` (SourceSyntaxError): the name defaults to the source's (the id's last part)."""
    name, separator, rest = text.partition("=")
    if separator and _SERVED_NAME.match(name) and "/" not in name:
        source = parse_source(rest)
    else:
        name, source = "", parse_source(text)
    name = name or source.default_name
    if not _SERVED_NAME.match(name):
        raise SourceSyntaxError(f"--model {text}: {name!r} cannot be a model's name (give one: NAME=SOURCE)")
    return NamedSource(name, source)
