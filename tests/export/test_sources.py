"""A model's source: huggingface_hub's real resolution on a hub cache the tests make, and each bad source's line.

`python -m export --export-cache` runs as users run it (a subprocess, HF_* in its environment): a bad source is
one line on stderr and exit status 2, with nothing written into the export cache.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from service.core.sources import SourceSyntaxError, parse_model_argument, parse_source
from tests.hub_cache import FakeHub, TinyHub, hub_environment, make_tiny_hub
from tests.servers import free_port


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> TinyHub:
    """tiny-org/tiny-st at v1 and main."""
    return make_tiny_hub(tmp_path_factory.mktemp("tiny-hub"))


def run_export(environment: dict[str, str], *arguments: str, file_size_limit: int = 0) -> subprocess.CompletedProcess:
    """`python -m export ARGUMENTS` with the environment given; a file size limit (bytes) stands in for a full disk."""

    def limit() -> None:
        if file_size_limit:
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    return subprocess.run(
        [sys.executable, "-m", "export", *arguments],
        env={**os.environ, **environment},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        preexec_fn=limit,
    )


def entries(cache: Path) -> list[str]:
    """What the export cache holds, hidden folders (locks, partial entries) included."""
    return sorted(path.name for path in cache.iterdir()) if cache.is_dir() else []


def test_sources_read_as_ids_or_folders(tmp_path: Path) -> None:
    plain, with_scheme = parse_source("org/name"), parse_source("hf://org/name")
    assert (plain.repo_id, plain.revision) == (with_scheme.repo_id, with_scheme.revision) == ("org/name", "")
    source = parse_source("hf://BAAI/bge-m3@refs/pr/7")
    assert (source.repo_id, source.revision, source.default_name) == ("BAAI/bge-m3", "refs/pr/7", "bge-m3")
    (tmp_path / "org" / "name").mkdir(parents=True)
    cwd = Path.cwd()
    os.chdir(tmp_path)
    try:
        assert parse_source("org/name").folder == Path("org/name")  # a folder that exists wins
    finally:
        os.chdir(cwd)
    named = parse_model_argument(f"reranker={tmp_path / 'org' / 'name'}")
    assert (named.name, named.source.on_hub) == ("reranker", False)
    assert parse_model_argument("sentence-transformers/all-MiniLM-L6-v2@main").name == "all-MiniLM-L6-v2"
    with pytest.raises(SourceSyntaxError, match="not a Hugging Face id"):
        parse_source("hf://just-a-name")


@pytest.mark.parametrize("revision", ["v1", "main", "commit"])
def test_an_id_resolves_to_the_snapshot_of_its_revision(hub: TinyHub, tmp_path: Path, revision: str) -> None:
    """huggingface_hub's resolution (offline, from the cache): the revision's snapshot, its commit recorded."""
    asked = hub.commits["v1"] if revision == "commit" else revision
    wanted = "v1" if revision == "commit" else revision
    code = (
        "from export.sources import resolve; from service.core.sources import parse_source;"
        f"r = resolve(parse_source('hf://{hub.repo_id}@{asked}'), lambda line: None); print(r.folder, r.commit)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **hub_environment(hub.hub)},
        capture_output=True,
        text=True,
        check=True,
    )
    folder, commit = result.stdout.split()
    assert commit == hub.commits[wanted]
    assert Path(folder).name == commit
    assert (Path(folder) / "model.safetensors").read_bytes() == (hub.folders[wanted] / "model.safetensors").read_bytes()


def test_an_id_not_in_the_cache_while_offline_is_one_line(hub: TinyHub, tmp_path: Path) -> None:
    cache = tmp_path / "export-cache"
    result = run_export(hub_environment(hub.hub), "--export-cache", str(cache), "--source", "tiny-org/absent")
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[-1] == (
        f"export: error: tiny-org/absent: not in the Hugging Face cache {hub.hub}, and HF_HUB_OFFLINE is set"
    )
    assert entries(cache) == []


@pytest.mark.parametrize(
    ("repo_id", "answer", "line"),
    [
        (
            "tiny-org/tiny-st@no-such-branch",
            (404, "RevisionNotFound"),
            "tiny-org/tiny-st: no revision 'no-such-branch' (branch, tag or commit) on {endpoint}",
        ),
        (
            "tiny-org/gated",
            (403, "GatedRepo"),
            "tiny-org/gated is gated: accept its terms on the Hub, then give a token that may read it (HF_TOKEN)",
        ),
        (
            "tiny-org/private",
            (401, "RepoNotFound"),
            "tiny-org/private: no such repository on {endpoint}, or it is private and HF_TOKEN is not set",
        ),
    ],
)
def test_the_hubs_refusals_are_one_line(
    hub: TinyHub, tmp_path: Path, repo_id: str, answer: tuple[int, str], line: str
) -> None:
    """The Hub's own error answers (a loopback HF_ENDPOINT sends them as the Hub does), through huggingface_hub."""
    cache = tmp_path / "export-cache"
    with FakeHub({repo_id.split("@", maxsplit=1)[0]: answer}) as fake:
        environment = hub_environment(tmp_path / "empty-hub", offline=False) | {"HF_ENDPOINT": fake.endpoint}
        result = run_export(environment, "--export-cache", str(cache), "--source", repo_id)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[-1] == "export: error: " + line.format(endpoint=fake.endpoint)
    assert entries(cache) == []


def test_a_network_failure_is_one_line_after_bounded_retries(tmp_path: Path) -> None:
    cache, endpoint = tmp_path / "export-cache", f"http://127.0.0.1:{free_port()}"  # nothing listens there
    environment = hub_environment(tmp_path / "empty-hub", offline=False) | {"HF_ENDPOINT": endpoint}
    result = run_export(environment, "--export-cache", str(cache), "--source", "tiny-org/tiny-st")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert sum("trying again" in line for line in lines) == 2
    assert lines[-1] == (
        f"export: error: tiny-org/tiny-st: the Hub at {endpoint} cannot be reached (ConnectError) after 3 tries,"
        f" and {tmp_path / 'empty-hub'} does not hold it"
    )
    assert entries(cache) == []


def test_a_folder_that_is_no_model_is_one_line(tmp_path: Path) -> None:
    folder, cache = tmp_path / "not-a-model", tmp_path / "export-cache"
    folder.mkdir()
    (folder / "README.md").write_text("no model here\n")
    result = run_export({}, "--export-cache", str(cache), "--source", str(folder))
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[-1] == f"export: error: {folder}: no config.json"
    assert [name for name in entries(cache) if not name.startswith(".")] == []
    assert not any(name.startswith(".partial") for name in entries(cache))


def test_an_architecture_the_exporter_refuses_is_its_refusal_line(tmp_path: Path) -> None:
    folder, cache = tmp_path / "gpt2", tmp_path / "export-cache"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "gpt2"}')
    result = run_export({}, "--export-cache", str(cache), "--source", str(folder))
    assert result.returncode == 2, result.stderr
    last = result.stderr.splitlines()[-1]
    assert last.startswith(f"export: error: {folder}: unsupported architecture 'gpt2' (supported: bert,")
    assert not any(name.startswith(".partial") or not name.startswith(".") for name in entries(cache))


def test_a_full_disk_during_the_export_is_one_line_and_no_entry(hub: TinyHub, tmp_path: Path) -> None:
    """A file size limit makes every write past it fail as a full disk does (EFBIG, as ENOSPC): no entry is left."""
    cache = tmp_path / "export-cache"
    result = run_export(
        hub_environment(hub.hub),
        "--export-cache", str(cache),
        "--source", hub.repo_id,
        "--variants", "fp32",
        "--threads", "1",
        file_size_limit=64 * 1024,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[-1].startswith("export: error: no room left writing the export (File too large")
    assert [name for name in entries(cache) if name != ".locks"] == []
