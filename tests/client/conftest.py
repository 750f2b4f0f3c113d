"""Fixtures of the client tests: a deliberately slow server with a one-request queue."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.servers import RunningServer, start_server


@pytest.fixture(scope="session")
def slow_server(tiny_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> RunningServer:
    """The tiny model behind a queue of one request that waits 1 s for a fuller batch.

    A lone request answers after about 1 s (so a short deadline expires); a second one arriving
    meanwhile is rejected with RESOURCE_EXHAUSTED.
    """
    log_path = tmp_path_factory.mktemp("slow-server") / "server.log"
    server = start_server(tiny_repository, log_path, "--max-queue-size", "1", "--max-queue-delay-us", "1000000")
    yield server
    server.stop()


def requests_answered(server: RunningServer) -> float:
    """encoder_requests_total summed over every label: inference requests the server answered."""
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "encoder_requests_total"
    )
