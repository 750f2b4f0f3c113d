"""A Hugging Face hub cache made by the tests (no network): the layout huggingface_hub documents, filled with folders.

    HUB/models--org--name/blobs/<sha256 of the file>
    HUB/models--org--name/snapshots/<commit>/<file>   -> ../../blobs/<sha256> (relative links, as the library makes)
    HUB/models--org--name/refs/<branch or tag>          the commit

Run the code under test with HF_HUB_CACHE=HUB and HF_HUB_OFFLINE=1 (hub_environment): huggingface_hub's own
resolution then runs on it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def add_snapshot(hub: Path, repo_id: str, folder: Path, refs: tuple[str, ...] = ("main",), seed: str = "") -> str:
    """Store folder's files as one commit of repo_id, pointed at by refs; the commit's hash."""
    repository = hub / f"models--{repo_id.replace('/', '--')}"
    files = sorted(path for path in folder.rglob("*") if path.is_file())
    digest = hashlib.sha1(seed.encode())
    for path in files:
        digest.update(path.relative_to(folder).as_posix().encode() + path.read_bytes())
    commit = digest.hexdigest()
    for path in files:
        content = path.read_bytes()
        blob = repository / "blobs" / hashlib.sha256(content).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(content)
        link = repository / "snapshots" / commit / path.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repository / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repository / "refs" / ref).write_text(commit)
    return commit


def hub_environment(hub: Path, export_cache: Path | None = None, offline: bool = True) -> dict[str, str]:
    """The environment that points huggingface_hub (and the export cache) at the test's folders."""
    environment = {
        "HF_HUB_CACHE": str(hub),
        "HF_HUB_OFFLINE": "1" if offline else "0",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_TOKEN": "",
    }
    if export_cache is not None:
        environment["ENCODER_EXPORT_CACHE"] = str(export_cache)
    return environment
