"""Serving a model by its name: `python -m service --model org/name[@REVISION]`, exported at start into a cache.

Real servers on loopback ports, the real exporter in its subprocess, huggingface_hub's real resolution on a
hub cache the tests make (tests.hub_cache, HF_HUB_OFFLINE=1). What the server did is read from its answers,
its health, its log (the exporter's `cache hit` / `cache miss` lines) and the export cache's folder.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from grpc_health.v1 import health_pb2
from sentence_transformers import SentenceTransformer

from tests.conftest import TINY_MODEL
from tests.hub_cache import TinyHub, hub_environment, make_tiny_hub
from tests.servers import RunningServer, free_port, health_status, post_json, start_server, wait_until
from tools.local_server import launch_server

TEXTS = ["a first sentence", "the second one is a little longer than the first", "three"]
NAME = "tiny-st"
"""The served name of tiny-org/tiny-st: the id's last part."""


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> TinyHub:
    """tiny-org/tiny-st at v1 and main."""
    return make_tiny_hub(tmp_path_factory.mktemp("tiny-hub"))


@pytest.fixture(scope="module")
def export_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The export cache the module's first server fills (and the second one finds full)."""
    return tmp_path_factory.mktemp("export-cache")


@pytest.fixture
def no_repository(tmp_path: Path) -> Path:
    """An empty model repository: the server serves only what --model names."""
    folder = tmp_path / "empty-repository"
    folder.mkdir()
    return folder


@pytest.fixture(scope="module")
def served(
    hub: TinyHub, export_cache: Path, tiny_repository: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    """A server of the tiny repository and of tiny-org/tiny-st@v1 by name (an export: the cache starts empty)."""
    log = tmp_path_factory.mktemp("served") / "server.log"
    arguments = ("--model", f"{hub.repo_id}@v1", "--export-cache", str(export_cache))
    server = start_server(tiny_repository, log, *arguments, env=hub_environment(hub.hub))
    try:
        yield server
    finally:
        server.stop()


def embeddings(server: RunningServer, model: str = NAME) -> np.ndarray:
    """The server's embeddings of TEXTS (OpenAI's route)."""
    status, body = post_json(server, "/v1/embeddings", {"model": model, "input": TEXTS})
    assert status == 200, body
    return np.array([row["embedding"] for row in body["data"]], dtype=np.float32)


def library_embeddings(folder: Path) -> np.ndarray:
    """sentence-transformers' own embeddings of TEXTS, on the folder."""
    return SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_numpy=True)


def cache_listing(cache: Path) -> tuple[list[str], list[str]]:
    """(entries, partial entries) of an export cache."""
    names = sorted(path.name for path in cache.iterdir()) if cache.is_dir() else []
    return [n for n in names if not n.startswith(".")], [n for n in names if n.startswith(".partial-")]


def test_a_served_id_answers_like_sentence_transformers_on_its_revision(served: RunningServer, hub: TinyHub) -> None:
    """@v1 is v1's snapshot (not main's), exported and served beside the repository's own model."""
    served_rows = embeddings(served)
    np.testing.assert_allclose(served_rows, library_embeddings(hub.folders["v1"]), atol=2e-5)
    assert not np.allclose(served_rows, library_embeddings(hub.folders["main"]), atol=1e-2)
    assert embeddings(served, TINY_MODEL).shape[0] == len(TEXTS)  # --model-repository's model too
    assert "cache miss" in served.log()
    assert f"resolved {hub.repo_id}@v1 to commit {hub.commits['v1']}" in served.log()


def test_a_second_start_on_the_same_cache_exports_nothing(
    served: RunningServer, hub: TinyHub, export_cache: Path, no_repository: Path, tmp_path: Path
) -> None:
    arguments = ("--model", f"{hub.repo_id}@v1", "--export-cache", str(export_cache))
    with start_server(no_repository, tmp_path / "again.log", *arguments, env=hub_environment(hub.hub)) as again:
        np.testing.assert_array_equal(embeddings(again), embeddings(served))
        log = again.log()
    entry = cache_listing(export_cache)[0]
    assert f"cache hit: {export_cache / entry[0]}" in log
    assert "cache miss" not in log and not re.search(r"stage\s+\d+ of", log)


def _http_status(server: RunningServer, route: str) -> int:
    try:
        with urllib.request.urlopen(server.http_url + route, timeout=5) as answer:
            return answer.status
    except urllib.error.HTTPError as error:
        return error.code


def _not_ready_reason(server: RunningServer, model: str) -> str:
    status, body = post_json(server, "/v1/embeddings", {"model": model, "input": "x"})
    return body["error"]["message"] if status == 503 else ""


def test_a_killed_export_leaves_no_entry_and_two_servers_then_export_once(
    hub: TinyHub, no_repository: Path, tmp_path: Path
) -> None:
    """Exporting: live, not ready, inference 503 naming the stage. Killed: no entry. Then two at once: one export."""
    cache, environment = tmp_path / "export-cache", hub_environment(hub.hub)
    arguments = ("--intra-op-threads", "1", "--model", f"shared={hub.repo_id}", "--export-cache", str(cache))
    first = launch_server(no_repository, tmp_path / "killed.log", *arguments, env=environment)
    try:
        wait_until(lambda: re.search(r"stage\s+3 of", first.log()) is not None, "reached its export's third stage")
        wait_until(lambda: "exporting: stage" in _not_ready_reason(first, "shared"), "said its export's stage")
        assert re.fullmatch(
            r"model shared is not ready: exporting: stage \d+ of \d+, .+", _not_ready_reason(first, "shared")
        )
        assert _http_status(first, "/v2/health/live") == 200
        assert _http_status(first, "/v2/health/ready") == 503
        assert _http_status(first, "/v2/models/shared/ready") == 503
        assert health_status(first.target, "shared") == health_pb2.HealthCheckResponse.NOT_SERVING
        assert cache_listing(cache)[1], "the export had begun writing its partial entry"
    finally:
        os.killpg(first.process.pid, signal.SIGKILL)  # the server and its exporter, mid-export
        first.process.wait()
    assert cache_listing(cache)[0] == []
    # The second a server of several processes: its engine process exports, its front ends hear where the model is.
    layouts = [(), ("--frontends", "2")]
    servers = [
        launch_server(no_repository, tmp_path / f"{i}.log", *arguments, *layout, env=environment)
        for i, layout in enumerate(layouts)
    ]
    try:
        for server in servers:
            server.wait_until_serving()
        logs = [server.log() for server in servers]
        np.testing.assert_array_equal(embeddings(servers[0], "shared"), embeddings(servers[1], "shared"))
    finally:
        for server in servers:
            server.stop()
    assert sum("cache miss" in log for log in logs) == 1
    assert sum("cache hit" in log for log in logs) == 1
    assert "left by an export that did not finish" in next(log for log in logs if "cache miss" in log)
    entries, partials = cache_listing(cache)
    assert len(entries) == 1 and entries[0].startswith("shared-") and partials == []


def _failed_start(environment: dict[str, str], *arguments: str) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable, "-m", "service",
        "--host", "127.0.0.1",
        "--grpc-port", str(free_port()),
        "--http-port", str(free_port()),
        "--metrics-port", str(free_port()),
        *arguments,
    ]  # fmt: skip
    return subprocess.run(
        command, capture_output=True, text=True, timeout=180, check=False, env={**os.environ, **environment}
    )


def test_a_bad_source_stops_the_server_with_its_line(hub: TinyHub, tmp_path: Path) -> None:
    """An id not in the cache while offline, and a folder the exporter refuses: exit 2, one error line, no entry."""
    cache = tmp_path / "export-cache"
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text('{"model_type": "gpt2"}')
    expected = {
        "tiny-org/absent": (
            f"service: error: model absent: tiny-org/absent: not in the Hugging Face cache {hub.hub},"
            " and HF_HUB_OFFLINE is set"
        ),
        str(gpt2): f"service: error: model gpt2: {gpt2}: unsupported architecture 'gpt2' (supported: bert,",
    }
    for source, line in expected.items():
        finished = _failed_start(hub_environment(hub.hub, cache), "--model", source)
        assert finished.returncode == 2, finished.stderr
        assert "Traceback" not in finished.stderr
        errors = [text for text in finished.stderr.splitlines() if text.startswith("service: error: ")]
        assert len(errors) == 1 and errors[0].startswith(line), finished.stderr
    assert cache_listing(cache) == ([], [])
