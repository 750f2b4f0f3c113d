"""Retries against a real server: a tenant over its requests/s limit is refused RESOURCE_EXHAUSTED with a retry hint,
which the client honours; refusals that a retry cannot cure are raised at once.

The tenant's bucket refills one request in 1000 s, so every call after its first is refused however fast or slow
this machine is; the client's sleeps are recorded instead of waited (a clock the test holds).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import client.blocking
from client import EmbeddingClient, Overloaded, RetryPolicy
from tests.conftest import TINY_MODEL
from tests.servers import RunningServer, start_server

KEY = "sk-slow-tenant"
REFILL_S = 1000
"""The tenant's one request comes back after this long: never within a test."""


@pytest.fixture(scope="module")
def limited_server(tiny_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """The tiny model for one tenant allowed one request every REFILL_S (burst 1)."""
    folder = tmp_path_factory.mktemp("tenant-server")
    tenants = folder / "tenants.toml"
    tenants.write_text(f'[tenants.slow]\nkeys = ["{KEY}"]\nrequests_per_second = {1 / REFILL_S}\n')
    with start_server(tiny_repository, folder / "server.log", "--api-key-file", str(tenants)) as server:
        yield server


class RecordedSleeps:
    """The blocking client's `time` in a test: each sleep is recorded and returns at once."""

    def __init__(self) -> None:
        self.slept_s: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.slept_s.append(seconds)


def test_a_tenants_limit_carries_a_hint_that_the_client_waits_for(
    limited_server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    with EmbeddingClient(
        limited_server.target, model=TINY_MODEL, api_key=KEY, retry=RetryPolicy(max_attempts=1)
    ) as once:
        once.embed(["the bucket's one request"])
        with pytest.raises(Overloaded) as refused:
            once.embed(["refused at once"])
    hint_s = refused.value.retry_after_s
    assert hint_s is not None and REFILL_S - 60 <= hint_s <= REFILL_S and "slow" in refused.value.message
    # Backoff alone waits 2 ms at most; the client waits the server's hint instead, before each try again.
    sleeps = RecordedSleeps()
    monkeypatch.setattr(client.blocking, "time", sleeps)
    quick = RetryPolicy(max_attempts=3, initial_backoff_s=0.001, max_backoff_s=0.002)
    with EmbeddingClient(limited_server.target, model=TINY_MODEL, api_key=KEY, retry=quick) as patient:
        with pytest.raises(Overloaded):
            patient.embed(["refused, tried again after the hint, refused again"])
        assert patient.retries == 2
    assert len(sleeps.slept_s) == 2 and all(REFILL_S - 60 <= slept <= REFILL_S for slept in sleeps.slept_s)
