"""A real Prometheus scrapes a running server (our metrics and Triton's); promtool lints our exposition."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton

from tests.conftest import PROMETHEUS_INSTALL, TINY_MODEL, require_tool
from tests.servers import RunningServer, free_port, start_server


@pytest.fixture(scope="module", autouse=True)
def prometheus_installed() -> None:
    """Skip where Debian's prometheus package is missing; fail there under `make test` and CI."""
    require_tool("prometheus", PROMETHEUS_INSTALL)
    require_tool("promtool", PROMETHEUS_INSTALL)


def query(port: int, expression: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expression})
    with urllib.request.urlopen(url, timeout=5) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    return body["data"]["result"]


def test_promtool_accepts_our_metrics(tiny_server: RunningServer) -> None:
    exposition = urllib.request.urlopen(tiny_server.metrics_url, timeout=5).read()
    assert b"nv_inference" not in exposition  # Triton's names (not Prometheus-style) only with --triton-metrics
    result = subprocess.run(
        ["promtool", "check", "metrics"], input=exposition, capture_output=True, check=False, timeout=30
    )
    problems = [line for line in result.stdout.decode().splitlines() + result.stderr.decode().splitlines() if line]
    assert result.returncode == 0 and not problems, problems


def test_prometheus_scrapes_the_request_counter(tiny_repository: Path, tmp_path: Path) -> None:
    with start_server(tiny_repository, tmp_path / "server.log", "--triton-metrics") as server:
        prometheus_port = free_port()
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n"
            "scrape_configs:\n"
            "  - job_name: encoder\n"
            f"    static_configs:\n      - targets: ['127.0.0.1:{server.metrics_port}']\n"
        )
        with (tmp_path / "prometheus.log").open("w") as prometheus_log:
            prometheus = subprocess.Popen(
                [
                    "prometheus",
                    f"--config.file={config}",
                    f"--storage.tsdb.path={tmp_path / 'data'}",
                    f"--web.listen-address=127.0.0.1:{prometheus_port}",
                ],
                stdout=subprocess.DEVNULL,
                stderr=prometheus_log,
            )
        try:
            client = triton.InferenceServerClient(server.target)
            for index in range(7):
                tensor = triton.InferInput("text", [1], "BYTES")
                tensor.set_data_from_numpy(np.array([f"scraped request {index}".encode()], dtype=object))
                client.infer(TINY_MODEL, [tensor])
            expression = f'encoder_requests_total{{job="encoder",model="{TINY_MODEL}",code="OK"}}'
            # Waits (bounded) for Prometheus to start and scrape; what is asserted is the value it scraped.
            deadline = time.monotonic() + 60
            seen = None
            while time.monotonic() < deadline:
                try:
                    result = query(prometheus_port, expression)
                except OSError:
                    result = []  # Prometheus still starting
                if result:
                    seen = float(result[0]["value"][1])
                    if seen == 7:
                        break
                time.sleep(0.5)
            assert seen == 7, (seen, (tmp_path / "prometheus.log").read_text()[-2000:])
            # Triton's own counter, from the same scrape, for dashboards written for Triton.
            triton_expression = f'nv_inference_request_success{{job="encoder",model="{TINY_MODEL}",version="1"}}'
            assert [float(sample["value"][1]) for sample in query(prometheus_port, triton_expression)] == [7]
            up = query(prometheus_port, 'up{job="encoder"}')
            assert up and up[0]["value"][1] == "1"
        finally:
            prometheus.terminate()
            try:
                prometheus.wait(timeout=30)
            except subprocess.TimeoutExpired:
                prometheus.kill()
                prometheus.wait()
