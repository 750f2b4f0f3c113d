"""deploy/loadtest/locustfile.py run by Locust itself, headless, against the tiny server (plaintext and TLS)."""

from __future__ import annotations

import csv
import os
import subprocess
from pathlib import Path

from tests.conftest import TINY_MODEL, Pki, require_tool
from tests.servers import ROOT, RunningServer

LOCUSTFILE = ROOT / "deploy" / "loadtest" / "locustfile.py"


def locust_command() -> list[str]:
    """The locust executable of this virtualenv (or on PATH)."""
    return [require_tool("locust", "`make setup` installs it into the venv (PyPI locust, in the test extra)")]


def run_locust(target: str, folder: Path, seconds: int, *options: str, env: dict[str, str] | None = None) -> dict:
    """Run the locustfile headless with two users; its stats CSV's rows by name."""
    command = [
        *locust_command(),
        *("-f", str(LOCUSTFILE), "--headless", "-u", "2", "-r", "2", "-t", f"{seconds}s", "--only-summary"),
        *("--host", target, "--csv", str(folder / "stats"), "--model", TINY_MODEL, *options),
    ]
    python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    environment = {**os.environ, **(env or {}), "PYTHONPATH": python_path}
    finished = subprocess.run(
        command, cwd=folder, env=environment, capture_output=True, text=True, timeout=90, check=False
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    with (folder / "stats_stats.csv").open(newline="") as file:
        return {row["Name"]: row for row in csv.DictReader(file)}


def test_locust_users_report_requests_without_failures(tiny_server: RunningServer, tmp_path: Path) -> None:
    rows = run_locust(tiny_server.target, tmp_path, 10, "--mix", "short=0.8,long=0.2", "--batch-size", "2")
    total = rows["Aggregated"]
    assert int(total["Request Count"]) > 0 and int(total["Failure Count"]) == 0
    assert {name for name in rows if name != "Aggregated"} <= {"ModelInfer short", "ModelInfer long"}
    assert all(rows[name]["Type"] == "grpc" for name in rows if name != "Aggregated")


def test_locust_users_reach_a_tls_server_with_an_api_key_from_the_environment(
    tls_server: RunningServer, pki: Pki, tmp_path: Path
) -> None:
    env = {"ENCODER_CLIENT_TLS_CA": str(pki.ca), "ENCODER_CLIENT_API_KEY_FILE": str(pki.api_key_file)}
    total = run_locust(tls_server.target, tmp_path, 5, env=env)["Aggregated"]
    assert int(total["Request Count"]) > 0 and int(total["Failure Count"]) == 0
