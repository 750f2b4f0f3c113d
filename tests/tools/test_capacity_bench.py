"""The capacity and transport benches' measuring parts, against real processes (figures are never asserted)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.servers import RunningServer, start_server
from tools.capacity_bench import engine_at_saturation, engine_socket, measure, roles
from tools.ipc_bench import measure as measure_transport


@pytest.fixture(scope="module")
def server(tiny_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> RunningServer:
    log_path = tmp_path_factory.mktemp("capacity") / "server.log"
    running = start_server(tiny_repository, log_path, "--frontends", "2")
    try:
        yield running
    finally:
        running.stop()


def test_each_role_is_found_and_the_engine_socket_is_the_one_it_listens_on(server: RunningServer) -> None:
    by_role = roles(server)
    assert sorted(by_role) == ["engine", "frontend 1", "frontend 2", "supervisor"]
    assert engine_socket(by_role["engine"]).endswith("/engine.sock")
    with pytest.raises(RuntimeError, match=r"listens on no engine\.sock"):
        engine_socket(by_role["frontend 1"])


@pytest.mark.usefixtures("h2load_installed")
@pytest.mark.parametrize("protocol", ["grpc", "openai"])
def test_the_cpu_of_each_role_is_read_per_request(server: RunningServer, protocol: str) -> None:
    load = measure(server, protocol, seconds=1.5)
    # /proc counts in clock ticks (10 ms): a second and a half of requests costs each role some.
    assert load.requests_per_s > 0 and load.frontend_us > 0 and load.engine_us > 0
    # The total adds the supervisor's ticks to the same round's roles (to within float rounding).
    assert load.total_us >= (load.frontend_us + load.engine_us) * (1 - 1e-9)


def test_the_engine_is_driven_through_its_own_socket(server: RunningServer, tiny_repository: Path) -> None:
    saturation = engine_at_saturation(server, tiny_repository, seconds=1.5)
    # The event loop's thread is one of the engine's threads; the model runs on others.
    assert 0 < saturation.loop_us < saturation.engine_us


def test_the_transport_bench_measures_the_servers_own_transport() -> None:
    rate, front_end_us, engine_us = measure_transport("service.core.wire", callers=4, seconds=0.5)
    assert rate > 0 and front_end_us > 0 and engine_us > 0
