"""Retries against a real server: a tenant over its requests/s limit is refused RESOURCE_EXHAUSTED with a retry hint,
which the client honours; refusals that a retry cannot cure are raised at once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from client import EmbeddingClient, Overloaded, RetryPolicy
from tests.conftest import TINY_MODEL
from tests.servers import RunningServer, start_server

KEY = "sk-slow-tenant"


@pytest.fixture(scope="module")
def limited_server(tiny_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """The tiny model for one tenant allowed one request a second (burst 1)."""
    folder = tmp_path_factory.mktemp("tenant-server")
    tenants = folder / "tenants.toml"
    tenants.write_text(f'[tenants.slow]\nkeys = ["{KEY}"]\nrequests_per_second = 1\n')
    with start_server(tiny_repository, folder / "server.log", "--api-key-file", str(tenants)) as server:
        yield server


def test_a_tenants_limit_carries_a_hint_that_the_client_waits_for(limited_server: RunningServer) -> None:
    with EmbeddingClient(
        limited_server.target, model=TINY_MODEL, api_key=KEY, retry=RetryPolicy(max_attempts=1)
    ) as once:
        once.embed(["the bucket's one request"])
        with pytest.raises(Overloaded) as refused:
            once.embed(["refused at once"])
    assert refused.value.retry_after_s == 1 and "slow" in refused.value.message
    # Backoff alone (at most 2 ms, 3 tries) would give up long before the bucket refills; the hint makes it wait.
    quick = RetryPolicy(max_attempts=3, initial_backoff_s=0.001, max_backoff_s=0.002)
    with EmbeddingClient(limited_server.target, model=TINY_MODEL, api_key=KEY, retry=quick) as patient:
        patient.embed(["first"])
        assert patient.embed(["second, after the hint"]).shape == (1, 32)
        assert patient.retries >= 1
