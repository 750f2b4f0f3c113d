"""deploy/loadtest/locustfile.py run by Locust itself, headless, against the tiny server."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TINY_MODEL
from tests.servers import ROOT, RunningServer

LOCUSTFILE = ROOT / "deploy" / "loadtest" / "locustfile.py"


def locust_command() -> list[str]:
    """The locust executable of this virtualenv."""
    executable = Path(sys.executable).with_name("locust")
    if executable.exists():
        return [str(executable)]
    found = shutil.which("locust")
    if found is None:
        pytest.skip("locust is not installed")
    return [found]


def test_locust_users_report_requests_without_failures(tiny_server: RunningServer, tmp_path: Path) -> None:
    command = [
        *locust_command(),
        *("-f", str(LOCUSTFILE), "--headless", "-u", "2", "-r", "2", "-t", "10s", "--only-summary"),
        *("--host", tiny_server.target, "--csv", str(tmp_path / "stats"), "--model", TINY_MODEL),
        *("--mix", "short=0.8,long=0.2", "--batch-size", "2"),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    finished = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90, check=False)
    assert finished.returncode == 0, finished.stderr[-3000:]
    with (tmp_path / "stats_stats.csv").open(newline="") as file:
        rows = {row["Name"]: row for row in csv.DictReader(file)}
    total = rows["Aggregated"]
    assert int(total["Request Count"]) > 0 and int(total["Failure Count"]) == 0
    assert {name for name in rows if name != "Aggregated"} <= {"ModelInfer short", "ModelInfer long"}
    assert all(rows[name]["Type"] == "grpc" for name in rows if name != "Aggregated")
