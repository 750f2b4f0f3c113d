"""A Hugging Face hub cache made by the tests (no network): the layout huggingface_hub documents, filled with folders.

    HUB/models--org--name/blobs/<sha256 of the file>
    HUB/models--org--name/snapshots/<commit>/<file>   -> ../../blobs/<sha256> (relative links, as the library makes)
    HUB/models--org--name/refs/<branch or tag>          the commit

Run the code under test with HF_HUB_CACHE=HUB and HF_HUB_OFFLINE=1 (hub_environment): huggingface_hub's own
resolution then runs on it.
"""

from __future__ import annotations

import hashlib
import http.server
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from tests.export.tiny_models import save_sentence_transformer


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


@dataclass(frozen=True)
class TinyHub:
    """A hub cache holding one tiny sentence-transformers repository at two commits: tag v1, and main after it."""

    hub: Path
    repo_id: str
    folders: dict[str, Path]
    """Revision (v1, main) -> the folder stored as that commit."""
    commits: dict[str, str]
    """Revision (v1, main) -> its commit hash."""


def make_tiny_hub(root: Path) -> TinyHub:
    """Two tiny random sentence-transformers models (different weights) as two commits of tiny-org/tiny-st."""
    hub, repo_id = root / "hub", "tiny-org/tiny-st"
    folders = {revision: save_sentence_transformer("bert", root / revision, seed=seed) for revision, seed in TINY_SEEDS}
    commits = {revision: add_snapshot(hub, repo_id, folder, refs=(revision,)) for revision, folder in folders.items()}
    return TinyHub(hub, repo_id, folders, commits)


TINY_SEEDS = (("v1", 3), ("main", 4))
"""The tiny repository's revisions, oldest first, and the seed of each one's weights."""


class FakeHub:
    """A loopback HTTP endpoint (HF_ENDPOINT) answering the Hub's errors for named repositories, as the Hub sends them.

    `answers`: repo_id -> (HTTP status, X-Error-Code); anything else answers 404 RepoNotFound.
    """

    def __init__(self, answers: dict[str, tuple[int, str]]) -> None:
        self.answers = answers
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                parts = self.path.split("/")  # /api/models/<org>/<name>/revision/<revision>
                repo_id = "/".join(parts[3:5]) if len(parts) > 4 else ""
                status, code = hub.answers.get(repo_id, (404, "RepoNotFound"))
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", code)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, format: str, *args: object) -> None:
                """Quiet."""

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        """The URL to give as HF_ENDPOINT."""
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.server.shutdown()
        self.server.server_close()
