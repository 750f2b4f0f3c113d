"""The load generator and the stress suite over TLS, mutual TLS and API keys, against real servers.

Both take one ClientSecurity (protocol.channel_security), from flags or ENCODER_CLIENT_* variables, as the SDK does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import API_KEY, TINY_MODEL, Pki
from tests.servers import ROOT, RunningServer
from tools.loadtest.__main__ import main as loadtest_main
from tools.stress import StressConfig, run_suite


def test_loadtest_over_tls_with_a_key_from_flags(tls_server: RunningServer, pki: Pki, tmp_path: Path) -> None:
    arguments = [
        *("--target", tls_server.target, "--model", TINY_MODEL, "--concurrency", "2"),
        *("--duration-s", "0.8", "--warmup-s", "0.2", "--no-progress", "--output-dir", str(tmp_path)),
        *("--tls-ca", str(pki.ca), "--api-key-file", str(pki.api_key_file)),
    ]
    assert loadtest_main(arguments) == 0
    (json_path,) = tmp_path.glob("*.json")
    document = json.loads(json_path.read_text())
    (level,) = document["levels"]
    assert level["succeeded"] > 0 and level["failures_by_code"] == {}
    assert document["config"]["security"] == {
        "tls": True,
        "ca_file": str(pki.ca),
        "mutual_tls": False,
        "server_name": None,
        "api_key": True,
    }
    assert API_KEY not in json_path.read_text()


def test_loadtest_takes_mutual_tls_from_the_environment(mtls_server: RunningServer, pki: Pki, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "ENCODER_CLIENT_TLS_CA": str(pki.ca),
        "ENCODER_CLIENT_TLS_CERT": str(pki.client_cert),
        "ENCODER_CLIENT_TLS_KEY": str(pki.client_key),
    }
    command = [
        *(sys.executable, "-m", "tools.loadtest", "--target", mtls_server.target, "--model", TINY_MODEL),
        *("--concurrency", "1", "--duration-s", "0.5", "--warmup-s", "0", "--no-progress"),
        *("--output-dir", str(tmp_path)),
    ]
    finished = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert finished.returncode == 0, finished.stderr
    (level,) = json.loads(next(tmp_path.glob("*.json")).read_text())["levels"]
    assert level["succeeded"] > 0 and level["failed"] == 0
    # Without the client certificate the target check fails: one line, status 2.
    del env["ENCODER_CLIENT_TLS_CERT"], env["ENCODER_CLIENT_TLS_KEY"]
    refused = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert refused.returncode == 2
    # Its own line (grpc's C core may log the failed handshake before it).
    (error,) = [line for line in refused.stderr.splitlines() if line.startswith("loadtest: error: ")]
    assert error.startswith("loadtest: error: cannot use") and "UNAVAILABLE" in error


def test_loadtest_refuses_a_certificate_without_its_key(pki: Pki, capsys: pytest.CaptureFixture) -> None:
    arguments = ["--target", "127.0.0.1:1", "--tls-ca", str(pki.ca), "--tls-cert", str(pki.client_cert)]
    assert loadtest_main(arguments) == 2
    assert "--tls-key" in capsys.readouterr().err


async def test_stress_raw_connections_speak_tls_and_send_the_key(tls_server: RunningServer, pki: Pki) -> None:
    # The slow readers and garbage connections are hand-made HTTP/2; with TLS and a key their calls
    # must reach the model (HELD: the response waits on the reader), not be refused at the door.
    config = StressConfig(
        target=tls_server.target,
        model=TINY_MODEL,
        security=pki.security(api_key=True),
        scale=0.05,
        safety_timeout_s=30,
        phases=("slow_readers",),
    )
    result = await run_suite(config)
    slow, final = result.phases
    assert slow.outcomes == {"HELD": slow.sent} and slow.sent >= 8
    assert final.outcomes == {"OK": 1}
